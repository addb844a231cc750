"""Training loop across 2 real processes: DDP, split_batches, accumulation, fp16/bf16, clipping, OOM retry.

Run by tests/runtime/test_distributed.py; exits non-zero at the first failure.
"""

import atexit
import os

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from hasten import Accelerator, find_executable_batch_size
from hasten.state import reset_state
from hasten.utils import gather_object


def _process_group_must_be_gone():
    # Registered before hasten's own exit hook, so it runs after it (atexit is last-in, first-out).
    if dist.is_initialized():
        print(f"rank {dist.get_rank()}: the process group outlived the script; gloo may abort at exit", flush=True)
        os._exit(3)


atexit.register(_process_group_must_be_gone)
torch.manual_seed(0)
X, Y = torch.randn(64, 6), torch.randn(64, 2)


def model_factory():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def reference(steps: int, batch: int, lr: float = 0.1):
    """One process, full batches, plain PyTorch."""
    model = model_factory()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        x, y = X[step * batch : (step + 1) * batch], Y[step * batch : (step + 1) * batch]
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model


def max_diff(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def check_split_batches_equivalence():
    acc = Accelerator(split_batches=True)
    raw = model_factory()
    model, opt, loader = acc.prepare(
        raw, torch.optim.SGD(raw.parameters(), lr=0.1), DataLoader(TensorDataset(X, Y), batch_size=16)
    )
    assert isinstance(model, torch.nn.parallel.DistributedDataParallel)
    for x, y in loader:
        assert x.shape[0] == 8, "split_batches gives each process half the batch"
        opt.zero_grad()
        acc.backward(torch.nn.functional.mse_loss(model(x), y))
        grads = gather_object([[p.grad.clone() for p in model.parameters()]])
        assert all(torch.equal(a, b) for a, b in zip(grads[0], grads[1])), "DDP gradients differ between ranks"
        opt.step()
    diff = max_diff(acc.unwrap_model(model), reference(4, 16))
    assert diff < 1e-6, f"split_batches on 2 processes differs from 1 process by {diff}"
    reset_state()


def counting_hook(counter, bucket):
    """A DDP comm hook that counts its calls (in ``counter["calls"]``), then all-reduces as DDP does."""
    counter["calls"] += 1
    tensor = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(tensor, async_op=True).get_future().then(lambda fut: fut.value()[0])


def check_accumulation():
    acc = Accelerator(gradient_accumulation_steps=2)
    raw = model_factory()
    model, opt, loader = acc.prepare(
        raw, torch.optim.SGD(raw.parameters(), lr=0.1), DataLoader(TensorDataset(X, Y), batch_size=4)
    )
    counter = {"calls": 0}
    model.register_comm_hook(counter, counting_hook)
    per_step = []
    for x, y in loader:
        with acc.accumulate(model):
            before = counter["calls"]
            acc.backward(torch.nn.functional.mse_loss(model(x), y))
            per_step.append((acc.sync_gradients, counter["calls"] - before))
            opt.step()
            opt.zero_grad()
    assert all(n == 0 for sync, n in per_step if not sync), f"all-reduce during accumulation: {per_step}"
    assert all(n > 0 for sync, n in per_step if sync), f"no all-reduce on sync steps: {per_step}"
    assert [s for s, _ in per_step] == [False, True] * 4
    # Micro-batches go round-robin (batch i to rank i % 2), so each sync step covers 16 consecutive rows.
    ref = reference(4, 16)
    diff = max_diff(acc.unwrap_model(model), ref)
    assert diff < 1e-6, f"accumulation differs from the large-batch step by {diff}"
    reset_state()


def check_fp16_skip_and_scheduler():
    acc = Accelerator(mixed_precision="fp16")
    raw = model_factory()
    opt = torch.optim.SGD(raw.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt, sched = acc.prepare(raw, opt, sched)
    skipped = []
    for step in range(3):
        opt.zero_grad()
        acc.backward(torch.nn.functional.mse_loss(model(X[:8]), Y[:8]))
        if step == 1:
            next(iter(model.parameters())).grad[0, 0] = float("inf")
        opt.step()
        skipped.append(acc.optimizer_step_was_skipped)
        if not acc.optimizer_step_was_skipped:
            sched.step()
    assert skipped == [False, True, False], f"skips {skipped}"
    assert sched.scheduler.last_epoch == 2 * 2, (
        f"scheduler advanced {sched.scheduler.last_epoch} (2 real steps x 2 processes)"
    )
    reset_state()


def check_bf16_forward():
    acc = Accelerator(mixed_precision="bf16")
    raw = model_factory()
    seen = []
    raw[0].register_forward_hook(lambda mod, inp, out: seen.append(out.dtype))
    model = acc.prepare(raw)
    out = model(X[:4])
    assert seen == [torch.bfloat16] and out.dtype == torch.float32, f"inner {seen}, output {out.dtype}"
    with acc.autocast():
        assert torch.mm(X[:2], X[:2].T).dtype == torch.bfloat16
    reset_state()


def check_clip_grad_norm():
    acc = Accelerator()
    raw = model_factory()
    model, opt = acc.prepare(raw, torch.optim.SGD(raw.parameters(), lr=0.1))
    acc.backward(torch.nn.functional.mse_loss(model(X[:8]), Y[:8]) * 100)
    expected = torch.nn.utils.get_total_norm([p.grad for p in acc.unwrap_model(model).parameters()])
    norm = acc.clip_grad_norm_(model.parameters(), 0.5)
    assert torch.allclose(norm, expected), f"{norm} != {expected}"
    after = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    assert abs(after.item() - 0.5) < 1e-4, f"clipped norm {after}"
    reset_state()


def check_oom_agreement():
    acc = Accelerator()
    tried = []

    @find_executable_batch_size(starting_batch_size=64, reduce_batch_size_fn=lambda: tried[-1] // 2)
    def train(batch_size):
        tried.append(batch_size)
        if acc.process_index == 0 and batch_size == 64:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return batch_size

    final = train()
    assert gather_object([final]) == [32, 32], f"ranks ended at {gather_object([final])}"
    assert tried == [64, 32], f"rank {acc.process_index} tried {tried}"
    reset_state()


def check_local_sgd():
    from hasten.local_sgd import LocalSGD

    acc = Accelerator()
    raw = model_factory()
    model, opt = acc.prepare(raw, torch.optim.SGD(raw.parameters(), lr=0.1))
    rank = acc.process_index
    snapshots = []
    with LocalSGD(acc, model, local_sgd_steps=2) as local_sgd:
        for step in range(2):
            rows = slice(8 * rank + 16 * step, 8 * rank + 16 * step + 8)  # each rank its own data
            acc.backward(torch.nn.functional.mse_loss(model(X[rows]), Y[rows]))
            opt.step()
            opt.zero_grad()
            local_sgd.step()
            snapshots.append(gather_object([[p.detach().clone() for p in model.parameters()]]))
    differ = [not all(torch.equal(a, b) for a, b in zip(*snap)) for snap in snapshots]
    assert differ == [True, False], f"parameters must differ between ranks until the averaging step: {differ}"
    reset_state()


for check in (
    check_local_sgd,
    check_split_batches_equivalence,
    check_accumulation,
    check_fp16_skip_and_scheduler,
    check_bf16_forward,
    check_clip_grad_norm,
    check_oom_agreement,
):
    check()
print(f"rank {dist.get_rank()}: training checks passed")
