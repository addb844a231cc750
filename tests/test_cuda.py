"""GPU-only behaviour: CUDA autocast, the GradScaler on a real overflow, a real CUDA out-of-memory retry.

Skipped (with the reason) on machines without CUDA; run on a CUDA machine with `pytest -m cuda`.
"""

import pytest
import torch

from hasten import Accelerator, find_executable_batch_size

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


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
