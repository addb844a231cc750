"""FSDP2 training across 2 real processes, checked against DDP: parity, accumulation, clipping, memory,
sharding variants, mixed precision, optimizer rebinding, RAM-efficient loading, save_model, compile.

Run by tests/strategies/test_fsdp.py; exits non-zero at the first failure.
"""

import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from fsdp_model import batches, loss_fn, make_model
from safetensors.torch import load_file
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from hasten import Accelerator
from hasten.errors import ConfigError
from hasten.plugins.dynamo import TorchDynamoPlugin
from hasten.runtime.compilation import compile_model
from hasten.state import reset_state
from hasten.strategies.fsdp.plugin import FullyShardedDataParallelPlugin as Plugin

STEPS = 20
CLIP = 0.5


def train(acc, model, opt, steps, clip=CLIP):
    losses, norms = [], []
    for tokens in batches(STEPS, rank=acc.process_index)[:steps]:
        with acc.accumulate(model):
            loss = loss_fn(model, tokens)
            acc.backward(loss)
            if acc.sync_gradients and clip:
                norms.append(acc.clip_grad_norm_(model.parameters(), clip).item())
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    return losses, norms


def run(plugin=None, steps=STEPS, accumulation=1, mixed="no", inspect=None):
    acc = Accelerator(fsdp_plugin=plugin, gradient_accumulation_steps=accumulation, mixed_precision=mixed)
    raw = make_model()
    opt = torch.optim.AdamW(raw.parameters(), lr=1e-2)
    model, opt = acc.prepare(raw, opt)
    if inspect is not None:
        inspect(acc, model, opt)
    result = train(acc, model, opt, steps)
    reset_state()
    return result


def close(a, b, tol, what):
    worst = max(abs(x - y) / max(1.0, abs(y)) for x, y in zip(a, b))
    assert len(a) == len(b) and worst <= tol, f"{what}: differs by {worst:.3g} (tolerance {tol})\n{a}\n{b}"


def local_bytes(model):
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in model.parameters())


def inspect_sharding(acc, model, opt):
    assert isinstance(model, FSDPModule) and all(isinstance(layer, FSDPModule) for layer in model.layers), (
        "root and layers are sharded"
    )
    ids = {id(p) for p in model.parameters()}
    assert all(id(p) in ids for group in opt.param_groups for p in group["params"]), (
        "the optimizer was rebound to the sharded parameters"
    )
    assert all(isinstance(p, DTensor) for p in model.parameters())
    full = sum(p.numel() * p.element_size() for p in make_model().parameters())
    mine = local_bytes(model)
    everyone = [None, None]
    dist.all_gather_object(everyone, mine)
    assert sum(everyone) == full, f"the shards add up to the model: {everyone} vs {full}"
    ratio = mine / full
    assert 0.45 <= ratio <= 0.55, f"rank {acc.process_index} holds {ratio:.3f} of the parameters"
    print(f"MEMORY rank {acc.process_index}: {mine} of {full} parameter bytes ({ratio:.3f}); DDP holds {full}")


def check_parity(ddp):
    fsdp = run(Plugin(auto_wrap_policy="TRANSFORMER_BASED_WRAP"), inspect=inspect_sharding)
    close(fsdp[0], ddp[0], 1e-5, "FSDP vs DDP losses")
    close(fsdp[1], ddp[1], 1e-5, "FSDP vs DDP clip norms")
    assert all(n > CLIP for n in ddp[1][:3]), f"clipping is exercised: {ddp[1][:3]}"


def check_accumulation():
    ddp = run(accumulation=2)
    fsdp = run(Plugin(transformer_cls_names_to_wrap=["Block"]), accumulation=2)
    assert len(fsdp[1]) == STEPS // 2
    close(fsdp[0], ddp[0], 1e-5, "FSDP vs DDP losses with accumulation")
    close(fsdp[1], ddp[1], 1e-5, "FSDP vs DDP clip norms with accumulation")


def check_variants(ddp):
    variants = {
        "SHARD_GRAD_OP": Plugin(sharding_strategy="SHARD_GRAD_OP", auto_wrap_policy="TRANSFORMER_BASED_WRAP"),
        "NO_SHARD": Plugin(sharding_strategy="NO_SHARD"),
        "HYBRID_SHARD": Plugin(sharding_strategy="HYBRID_SHARD", transformer_cls_names_to_wrap="Block"),
        "size wrap + prefetch + checkpointing": Plugin(
            auto_wrap_policy="SIZE_BASED_WRAP",
            min_num_params=1000,
            forward_prefetch=True,
            activation_checkpointing=True,
        ),
        "cpu_offload": Plugin(cpu_offload=True, reshard_after_forward=False),
    }
    for name, plugin in variants.items():
        close(run(plugin, steps=4)[0], ddp[0][:4], 1e-5, f"{name} vs DDP")
    acc = Accelerator(fsdp_plugin=Plugin(ignored_modules="head", transformer_cls_names_to_wrap="Block"))
    model = acc.prepare(make_model())
    assert not isinstance(model.head.weight, DTensor) and isinstance(model.embed.weight, DTensor), (
        "ignored_modules stay unsharded"
    )
    reset_state()


def check_mixed_precision():
    seen = []
    ddp = run(steps=4, mixed="bf16")
    fsdp = run(
        Plugin(),
        steps=4,
        mixed="bf16",
        inspect=lambda acc, model, opt: model.head.register_forward_hook(
            lambda m, i, o: seen.append((m.weight.dtype, o.dtype))
        ),
    )
    close(fsdp[0], ddp[0], 2e-2, "bf16 FSDP vs bf16 DDP")
    assert seen[0] == (torch.bfloat16, torch.bfloat16), f"parameters are gathered in bf16: {seen[0]}"
    acc = Accelerator(fsdp_plugin=Plugin(), mixed_precision="fp16")
    raw = make_model()
    model, opt = acc.prepare(raw, torch.optim.SGD(raw.parameters(), lr=0.1))
    skipped = []
    for step, tokens in enumerate(batches(3, rank=acc.process_index)):
        acc.backward(loss_fn(model, tokens))
        assert model.head.weight.grad.dtype == torch.float32, "gradients are reduced and kept in fp32"
        if step == 1 and acc.process_index == 1:
            model.head.weight.grad.to_local()[0, 0] = float("inf")
        opt.step()
        opt.zero_grad()
        skipped.append(acc.optimizer_step_was_skipped)
    assert skipped == [False, True, False], f"an overflow on one rank skips the step on all ranks: {skipped}"
    reset_state()


def check_rebinding_and_errors():
    acc = Accelerator(fsdp_plugin=Plugin())
    raw = make_model()
    opt = torch.optim.SGD(raw.parameters(), lr=0.1)
    old = [p for p in raw.parameters()]
    model = acc.prepare_model(raw)
    opt = acc.prepare_optimizer(opt)
    new = list(model.parameters())
    assert all(a is b for a, b in zip(opt.param_groups[0]["params"], new)) and not any(a is b for a, b in zip(old, new))
    before = model.head.bias.to_local().clone()
    acc.backward(loss_fn(model, batches(1, rank=acc.process_index)[0]))
    opt.step()
    assert not torch.equal(before, model.head.bias.to_local()), "the step updates the sharded parameters"
    stray = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    try:
        acc.prepare(stray)
    except ConfigError as error:
        assert "belongs to no model prepared with FSDP" in str(error), error
    else:
        raise AssertionError("an optimizer over unknown parameters must be refused")
    reset_state()


def check_sync_controls():
    acc = Accelerator(fsdp_plugin=Plugin())
    model = acc.prepare(make_model())
    tokens = batches(1, rank=acc.process_index)[0]
    with acc.no_sync(model):
        loss_fn(model, tokens).backward()
        assert model.head.weight.grad is None, "no_sync: nothing reduced, gradients wait unsharded"
        with acc.trigger_sync_in_backward(model):
            loss_fn(model, tokens).backward()
        assert isinstance(model.head.weight.grad, DTensor), "trigger_sync_in_backward reduces inside no_sync"
        model.zero_grad()
        loss_fn(model, tokens).backward()
        assert model.head.weight.grad is None, "no_sync is in force again after trigger_sync_in_backward"
    reset_state()


def check_ram_efficient_loading():
    acc = Accelerator(fsdp_plugin=Plugin(cpu_ram_efficient_loading=True, transformer_cls_names_to_wrap=["Block"]))
    if acc.process_index == 0:
        raw = make_model()
    else:
        with torch.device("meta"):
            raw = make_model()
    model = acc.prepare(raw)
    assert float(model.scale) == 1.0, "non-persistent buffers come from process 0"
    state = acc.get_state_dict(model)
    if acc.process_index == 0:
        expected = make_model().state_dict()
        assert state.keys() == expected.keys() and all(torch.equal(state[k], expected[k]) for k in expected), (
            "weights broadcast from process 0"
        )
    else:
        assert state == {}, "the full state dict is gathered on process 0 only"
    reset_state()


def check_save_model_and_compile(ddp):
    acc = Accelerator(fsdp_plugin=Plugin(auto_wrap_policy="TRANSFORMER_BASED_WRAP"))
    raw = make_model()
    model, opt = acc.prepare(raw, torch.optim.AdamW(raw.parameters(), lr=1e-2))
    compiled = compile_model(model, TorchDynamoPlugin(backend="aot_eager"))
    losses, _ = train(acc, compiled, opt, 3)
    close(losses, ddp[0][:3], 1e-5, "compiled FSDP vs DDP")
    assert acc.unwrap_model(compiled, keep_torch_compile=False) is model
    tokens = batches(1, rank=0)[0][:, :-1]
    expected = compiled(tokens).detach()
    folder = [tempfile.mkdtemp() if acc.is_main_process else None]
    dist.broadcast_object_list(folder)
    acc.save_model(compiled, folder[0])
    state = acc.get_state_dict(compiled)
    if acc.is_main_process:
        assert not any("_orig_mod" in k for k in state), list(state)[:3]
        plain = make_model(seed=5)
        plain.load_state_dict(load_file(Path(folder[0]) / "model.safetensors"))
        assert torch.allclose(plain(tokens), expected, atol=1e-6), (
            "save_model reloads into a plain model with equal outputs"
        )
    reset_state()


ddp_run = run()
for check in (
    lambda: check_parity(ddp_run),
    check_accumulation,
    lambda: check_variants(ddp_run),
    check_mixed_precision,
    check_rebinding_and_errors,
    check_sync_controls,
    check_ram_efficient_loading,
    lambda: check_save_model_and_compile(ddp_run),
):
    check()
print(f"rank {dist.get_rank()}: fsdp training checks passed")
