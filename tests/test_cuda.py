"""GPU-only behaviour: CUDA autocast, the GradScaler on a real overflow, a real CUDA out-of-memory retry, what the fp32
conversion of outputs costs in GPU memory, and fp8 training with real float8 matmuls (or its refusal on an older GPU).

Skipped (with the reason) on machines without CUDA; run on a CUDA machine with `pytest -m cuda` (bench/device_check.sh
does, with the GPU benchmarks).
"""

import sys

import pytest
import torch
from helpers import SCRIPTS, requires

from hasten import Accelerator, find_executable_batch_size
from hasten.errors import ConfigError
from hasten.state import reset_state

sys.path.insert(0, str(SCRIPTS))
from fp8_model import TinyLM, batch, lm_loss  # noqa: E402

pytestmark = pytest.mark.cuda  # tests marked cuda need a CUDA device


def small_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 1))


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_mixed_precision_trains_on_cuda(precision):
    acc = Accelerator(mixed_precision=precision)
    assert acc.device.type == "cuda"
    raw = small_model()
    inner = []
    raw[0].register_forward_hook(lambda mod, inp, out: inner.append(out.dtype))
    model, opt = acc.prepare(raw, torch.optim.AdamW(raw.parameters(), lr=1e-2))
    x = torch.randn(256, 64, device=acc.device)
    y = x[:, :1] * 2
    losses = []
    for _ in range(30):
        loss = torch.nn.functional.mse_loss(model(x), y)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert inner[0] == {"fp16": torch.float16, "bf16": torch.bfloat16}[precision]
    assert model(x).dtype == torch.float32
    assert losses[-1] < losses[0] * 0.5, losses
    assert (acc.scaler is not None) == (precision == "fp16")


def test_grad_scaler_skips_an_overflow_step_on_cuda():
    acc = Accelerator(mixed_precision="fp16")
    raw = small_model()
    model, opt = acc.prepare(raw, torch.optim.SGD(raw.parameters(), lr=0.1))
    x = torch.randn(8, 64, device=acc.device)
    skipped = []
    for step in range(3):
        acc.backward(model(x).float().pow(2).mean() * (6e4 if step == 1 else 1.0))  # 6e4 * scale overflows fp16
        before = model[0].weight.detach().clone()
        opt.step()
        opt.zero_grad()
        skipped.append((acc.optimizer_step_was_skipped, torch.equal(before, model[0].weight)))
    assert skipped[1] == (True, True) and not skipped[0][0] and not skipped[2][0], skipped


def test_real_cuda_out_of_memory_is_retried_at_a_smaller_batch():
    acc = Accelerator()
    free, _ = torch.cuda.mem_get_info()
    per_item = free // 48  # batch 128 and 64 do not fit, 32 does
    tried = []

    @find_executable_batch_size(starting_batch_size=128, reduce_batch_size_fn=lambda: tried[-1] // 2)
    def allocate(batch_size):
        tried.append(batch_size)
        block = torch.empty(batch_size * per_item, dtype=torch.uint8, device=acc.device)
        return block.numel() // per_item

    assert allocate() == 32 and tried == [128, 64, 32], tried


def test_optimizer_state_follows_the_model_to_the_gpu():
    model = small_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()  # the state exists, on the CPU, before prepare moves the model
    acc = Accelerator()
    model, opt = acc.prepare(model, opt)
    assert all(s["exp_avg"].device.type == "cuda" for s in opt.state.values())
    acc.backward(model(torch.randn(4, 64, device=acc.device)).sum())
    opt.step()


def _step_peak(model, inputs, targets, loss_under) -> int:
    """Bytes allocated at the peak of one forward + loss + backward, above what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with loss_under():
        logits = model(inputs)  # held through backward, as a loop that keeps the outputs does
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def test_keeping_outputs_in_bf16_costs_what_raw_autocast_costs_and_the_default_one_fp32_copy():
    """A wide-vocabulary model (logits 4096 x 32768, kept until after backward): with ``convert_outputs_to_fp32=False``
    (and the loss under ``accelerator.autocast()``) the step's peak is within 2 % of a raw autocast loop's; the
    default holds the fp32 logits instead of the bf16 ones, the bf16 logits' bytes more."""
    import contextlib

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Embedding(8192, 256), torch.nn.Linear(256, 32768)).cuda()

    inputs = torch.randint(0, 8192, (16, 256), device="cuda")
    targets = torch.randint(0, 32768, (16, 256), device="cuda")
    raw = model()
    raw_peak = _step_peak(raw, inputs, targets, lambda: torch.autocast("cuda", dtype=torch.bfloat16))
    accelerator = Accelerator(mixed_precision="bf16")
    default_peak = _step_peak(accelerator.prepare(model()), inputs, targets, contextlib.nullcontext)
    reset_state()
    from hasten.utils import AutocastKwargs

    accelerator = Accelerator(mixed_precision="bf16", kwargs_handlers=[AutocastKwargs(convert_outputs_to_fp32=False)])
    keep_peak = _step_peak(accelerator.prepare(model()), inputs, targets, accelerator.autocast)
    bf16_logits = 16 * 256 * 32768 * 2
    assert keep_peak <= 1.02 * raw_peak, (keep_peak, raw_peak)
    assert default_peak - keep_peak >= bf16_logits // 2, (default_peak, keep_peak, raw_peak)


@requires("torchao", "fp8 gpu")
def test_real_fp8_trains_a_tiny_lm_as_bf16_does():
    def train(precision):
        reset_state()
        torch.manual_seed(0)
        accelerator = Accelerator(mixed_precision=precision)
        model = TinyLM()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        model, optimizer = accelerator.prepare(model, optimizer)
        generator, losses = torch.Generator().manual_seed(1), []
        for _ in range(50):
            inputs, targets = (t.cuda() for t in batch(8, generator))
            loss = lm_loss(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
        return torch.stack(losses).tolist(), model

    bf16, _ = train("bf16")
    fp8, model = train("fp8")
    converted = sorted(name for name, module in model.named_modules() if type(module).__name__ == "Float8Linear")
    assert converted == ["blocks.0.fc", "blocks.0.out", "blocks.0.proj"]
    assert fp8[-1] < 0.2 * fp8[0] and max(abs(a - b) / b for a, b in zip(fp8, bf16)) < 0.1, list(zip(bf16, fp8))


@requires("torchao", "pre-fp8 gpu")
def test_fp8_is_refused_on_a_gpu_without_fp8_units():
    with pytest.raises(ConfigError, match=r"compute capability \d\.\d; fp8 needs 8\.9\+"):
        Accelerator(mixed_precision="fp8")
