"""hasten's distributed self-check, started by ``hasten test`` through ``hasten launch``.

Every process checks its place in the job, the collectives (all_reduce, all_gather, broadcast,
barrier) and one DDP training step whose weights must agree across processes and with the same
step taken on the full batch by one process. The first failing check is named and the process
exits with code 1; on success the main process prints the success line.
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist

from hasten import environment
from hasten.settings.launch import MIXED_PRECISION
from hasten.state import PartialState

SUCCESS = "Test is a success! You are ready for your distributed training!"


class CheckFailed(Exception):
    """One self-check did not hold."""


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


def check_state(state: PartialState) -> None:
    """The process knows its rank and the size of the job."""
    launch = environment.detect_launch()
    _check(
        state.num_processes == launch.world_size,
        f"num_processes is {state.num_processes}, the launcher says {launch.world_size}",
    )
    _check(
        state.process_index == launch.rank, f"process_index is {state.process_index}, the launcher says {launch.rank}"
    )
    _check(state.is_main_process == (state.process_index == 0), "is_main_process disagrees with process_index")
    if state.num_processes > 1:
        _check(dist.is_initialized(), "the process group is not initialized in a multi-process job")
        _check(dist.get_world_size() == state.num_processes, f"the process group has {dist.get_world_size()} ranks")
        ranks: list = [None] * state.num_processes
        dist.all_gather_object(ranks, state.process_index)
        _check(sorted(ranks) == list(range(state.num_processes)), f"process indices are not 0..n-1: {ranks}")


def check_collectives(state: PartialState) -> None:
    """all_reduce, all_gather, broadcast and barrier give the expected values."""
    n, rank, device = state.num_processes, state.process_index, state.device
    total = torch.tensor([rank + 1.0], device=device)
    dist.all_reduce(total)
    _check(total.item() == n * (n + 1) / 2, f"all_reduce(sum) gave {total.item()}, expected {n * (n + 1) / 2}")
    mine = torch.tensor([rank, 10.0 * rank], device=device)
    gathered = [torch.zeros(2, device=device) for _ in range(n)]
    dist.all_gather(gathered, mine)
    for source, value in enumerate(gathered):
        _check(value.tolist() == [source, 10.0 * source], f"all_gather: entry {source} is {value.tolist()}")
    shared = torch.arange(4.0, device=device) * (rank + 1)
    dist.broadcast(shared, src=0)
    _check(shared.tolist() == [0.0, 1.0, 2.0, 3.0], f"broadcast from rank 0 gave {shared.tolist()}")
    dist.barrier()


def check_training(state: PartialState) -> None:
    """One DDP step on each process's shard equals one step on the full batch."""
    n, rank, device = state.num_processes, state.process_index, state.device
    torch.manual_seed(0)
    inputs = torch.randn(8 * n, 4)
    targets = inputs.sum(dim=1, keepdim=True)
    model = torch.nn.Linear(4, 1).to(device)
    reference = copy.deepcopy(model)
    wrapped = model
    if n > 1:
        wrapped = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device] if device.type == "cuda" else None
        )
    shard_x, shard_y = inputs.chunk(n)[rank].to(device), targets.chunk(n)[rank].to(device)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    torch.nn.functional.mse_loss(wrapped(shard_x), shard_y).backward()
    optimizer.step()
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    torch.nn.functional.mse_loss(reference(inputs.to(device)), targets.to(device)).backward()
    reference_optimizer.step()
    for (name, trained), expected in zip(model.named_parameters(), reference.parameters()):
        _check(
            torch.allclose(trained, expected, rtol=1e-5, atol=1e-6),
            f"after one DDP step, {name} differs from the full-batch step",
        )
    if n > 1:
        flat = torch.cat([p.detach().flatten() for p in model.parameters()])
        copies = [torch.zeros_like(flat) for _ in range(n)]
        dist.all_gather(copies, flat)
        _check(all(torch.equal(c, flat) for c in copies), "after one DDP step the weights differ between processes")


def main() -> int:
    """Run the checks; returns the exit code."""
    state = PartialState()
    checks = [("process state", check_state), ("training step", check_training)]
    if state.num_processes > 1:
        checks.insert(1, ("collectives", check_collectives))
    try:
        for name, run in checks:
            run(state)
            state.print(f"  {name}: ok")
    except CheckFailed as exc:
        print(f"Self-check FAILED on process {state.process_index} ({name}): {exc}", file=sys.stderr, flush=True)
        return 1
    if state.is_main_process:
        precision = environment.launch_setting(MIXED_PRECISION)
        print(f"{state!r}Mixed precision in force: {precision}")
        print(SUCCESS, flush=True)
    state.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
