"""The operations of ``accelerate.utils`` on every process of a job, checked against the values each process knows
the others hold: ``debug_launcher(test_ops.main)`` (Accelerate's own test suite runs it so) or
``hasten launch test_ops.py``. A failed check raises ``AssertionError`` naming the operation and the values.
"""

from __future__ import annotations

import torch

from hasten.compat.operations import copy_tensor_to_devices
from hasten.runtime.operations import (
    broadcast,
    broadcast_object_list,
    gather,
    gather_object,
    pad_across_processes,
    reduce,
)
from hasten.state import PartialState


def _expect(got, expected, operation: str) -> None:
    got = got.tolist() if isinstance(got, torch.Tensor) else got
    assert got == expected, f"{operation} gave {got} on process {PartialState().process_index}, expected {expected}"


def check_gather(state: PartialState) -> None:
    """Every process's rows, in process order, on every process (nested structures too)."""
    n, rank = state.num_processes, state.process_index
    mine = torch.tensor([2.0 * rank, 2.0 * rank + 1], device=state.device)
    _expect(gather(mine), [float(i) for i in range(2 * n)], "gather")
    both = gather({"rows": mine, "rank": torch.tensor([rank], device=state.device)})
    _expect(both["rank"], list(range(n)), "gather of a dict")
    _expect(
        gather_object([rank, f"process {rank}"]),
        [item for r in range(n) for item in (r, f"process {r}")],
        "gather_object",
    )


def check_broadcast(state: PartialState) -> None:
    """Process 0's tensors and objects replace everyone's."""
    rank = state.process_index
    _expect(broadcast(torch.full((3,), float(rank), device=state.device)), [0.0, 0.0, 0.0], "broadcast")
    _expect(broadcast_object_list([rank, {"from": rank}]), [0, {"from": 0}], "broadcast_object_list")


def check_pad_across_processes(state: PartialState) -> None:
    """Each process's tensor is padded to the longest, at the end or at the start."""
    n, rank = state.num_processes, state.process_index
    mine = torch.arange(rank + 1, dtype=torch.int64, device=state.device) + 1
    _expect(
        pad_across_processes(mine, pad_index=-1),
        list(range(1, rank + 2)) + [-1] * (n - rank - 1),
        "pad_across_processes",
    )
    _expect(
        pad_across_processes(mine, pad_first=True),
        [0] * (n - rank - 1) + list(range(1, rank + 2)),
        "pad_across_processes(pad_first=True)",
    )


def check_reduce(state: PartialState) -> None:
    """Sums, means and maxima over the processes."""
    n, rank = state.num_processes, state.process_index
    mine = torch.tensor([rank + 1.0, 2.0 * rank], device=state.device)
    total = [n * (n + 1) / 2, float(n * (n - 1))]
    _expect(reduce(mine, "sum"), total, "reduce(sum)")
    _expect(reduce(mine, "mean"), [value / n for value in total], "reduce(mean)")
    _expect(reduce(mine, "max"), [float(n), 2.0 * (n - 1)], "reduce(max)")


def check_copy_tensor_to_devices(state: PartialState) -> None:
    """A tensor only process 0 holds reaches every process."""
    held = torch.tensor([[1, 2], [3, 4]], device=state.device) if state.is_main_process else None
    _expect(copy_tensor_to_devices(held), [[1, 2], [3, 4]], "copy_tensor_to_devices")


def main() -> None:
    """Run every check on this process."""
    state = PartialState()
    for check in (
        check_gather,
        check_broadcast,
        check_pad_across_processes,
        check_reduce,
        check_copy_tensor_to_devices,
    ):
        check(state)
        state.print(f"  {check.__name__.removeprefix('check_')}: ok")
    state.wait_for_everyone()


if __name__ == "__main__":
    main()
