"""Collectives whose inputs differ between the processes, outside debug mode. Usage: fault_runtime_mismatch.py

Every case must raise DistributedOperationException on both processes, naming the operation, the
collective number and each process's shapes and dtypes, and leave the process group usable (the
next case runs on it). Exits non-zero on the first case that does not; prints a summary line per rank.
"""

import sys

import torch

from hasten import Accelerator
from hasten.errors import DistributedOperationException
from hasten.runtime import hang_watchdog
from hasten.utils import broadcast, broadcast_object_list, gather, gather_object, pad_across_processes, reduce

accelerator = Accelerator()
rank = accelerator.process_index
checked = []


def expect_mismatch(case, call, *fragments):
    """``call()`` must raise on this process; its message must hold every fragment and this collective's number."""
    try:
        result = call()
    except DistributedOperationException as error:
        message = str(error)
        number = f"collective #{hang_watchdog.sequence()}"
        missing = [f for f in (*fragments, number) if f not in message]
        if missing:
            sys.exit(f"rank {rank}: {case}: the message lacks {missing}:\n{message}")
        checked.append(case)
        return
    sys.exit(f"rank {rank}: {case}: returned {result!r} instead of raising")


def mine(first, second):
    return first if rank == 0 else second


expect_mismatch(
    "gather shapes",
    lambda: gather(torch.ones(mine(10, 8), 4)),
    "Operation: `hasten.runtime.operations.gather`",
    "Process 0: [10, 4] float32",
    "Process 1: [8, 4] float32",
)
expect_mismatch(
    "gather dtypes",
    lambda: gather(torch.ones(4, 4, dtype=mine(torch.float32, torch.int32))),
    "Process 0: [4, 4] float32",
    "Process 1: [4, 4] int32",
)
expect_mismatch(
    "gather keys",
    lambda: gather({mine("a", "b"): torch.ones(2)}),
    "Process 0: {'a': [2] float32}",
    "Process 1: {'b': [2] float32}",
)
expect_mismatch(
    "gather structure",
    lambda: gather(mine((torch.ones(2), torch.ones(2)), (torch.ones(2),))),
    "Process 0: ([2] float32, [2] float32)",
    "Process 1: ([2] float32)",
)
expect_mismatch(
    "reduce shapes",
    lambda: reduce(torch.ones(mine(4, 3)), reduction="sum"),
    "Operation: `hasten.runtime.operations.reduce`",
    "Process 0: [4] float32",
    "Process 1: [3] float32",
)
expect_mismatch(
    "reduce dtypes",
    lambda: reduce(torch.ones(4, dtype=mine(torch.float32, torch.float64)), reduction="sum"),
    "Process 0: [4] float32",
    "Process 1: [4] float64",
)
expect_mismatch(
    "reduce reductions",
    lambda: reduce(torch.ones(4), reduction=mine("sum", "max")),
    "reduction='sum'",
    "reduction='max'",
)
expect_mismatch(
    "broadcast shapes",
    lambda: broadcast(torch.ones(mine(4, 3))),
    "Operation: `hasten.runtime.operations.broadcast`",
    "Process 0: [4] float32",
    "Process 1: [3] float32",
)
expect_mismatch(
    "broadcast dtypes",
    lambda: broadcast(torch.ones(3, dtype=mine(torch.float32, torch.int32))),
    "Process 0: [3] float32",
    "Process 1: [3] int32",
)
expect_mismatch(
    "broadcast sources",
    lambda: broadcast(torch.ones(3), from_process=mine(0, 1)),
    "from_process=0",
    "from_process=1",
)
expect_mismatch(
    "pad dimensions",
    lambda: pad_across_processes(torch.ones(*mine((2, 3), (2,)))),
    "Operation: `hasten.runtime.operations.pad_across_processes`",
    "Process 0: [2, 3] float32",
    "Process 1: [2] float32",
)
# Differing dtypes do not disturb the padding itself; the gather that follows refuses them.
padded = pad_across_processes(torch.ones(mine(2, 3), 3, dtype=mine(torch.float32, torch.int64)))
if padded.shape != (3, 3) or padded.sum().item() != mine(6, 9):
    sys.exit(f"rank {rank}: pad with differing dtypes gave {padded}")
expect_mismatch(
    "gather of padded dtypes", lambda: gather(padded), "Process 0: [3, 3] float32", "Process 1: [3, 3] int64"
)
loader = accelerator.prepare(torch.utils.data.DataLoader(torch.arange(8.0), batch_size=2))
for step, batch in enumerate(loader):
    if step == 0:
        expect_mismatch(
            "gather_for_metrics in a loop",
            lambda b=batch: accelerator.gather_for_metrics(b.to(mine(torch.float32, torch.float64))),
            "Operation: `hasten.runtime.operations.gather`",
            "Process 0: [2] float32",
            "Process 1: [2] float64",
        )
expect_mismatch(
    "gather_for_metrics trailing dims",
    lambda: accelerator.gather_for_metrics(torch.ones(3, mine(4, 5))),
    "Operation: `hasten.runtime.operations.gather`",  # equal first dimensions: Accelerate's plain gather path
    "Process 0: [3, 4] float32",
    "Process 1: [3, 5] float32",
)
expect_mismatch(
    "gather_for_metrics dtypes",
    lambda: accelerator.gather_for_metrics(torch.ones(mine(3, 2), 2, dtype=mine(torch.float32, torch.int64))),
    "Process 0: [3, 2] float32",
    "Process 1: [2, 2] int64",
)
expect_mismatch(
    "gather_object against gather",
    lambda: gather_object(["a"]) if rank == 0 else gather(torch.ones(1)),
    "the processes called different collectives",
    "Process 0: `gather_object`",
    "Process 1: `gather`",
)
expect_mismatch(
    "broadcast_object_list lengths",
    lambda: broadcast_object_list(mine([1, 2], [None])),
    "Operation: `hasten.runtime.operations.broadcast_object_list`",
)
expect_mismatch(
    "a rank that left the loop",
    lambda: gather(torch.ones(1)) if rank == 0 else accelerator.wait_for_everyone(),
    "Process 0: `gather`",
    "Process 1: `wait_for_everyone`",
)
together = gather(torch.full((2,), float(rank)))
if together.tolist() != [0.0, 0.0, 1.0, 1.0]:
    sys.exit(f"rank {rank}: the group is broken after the mismatches: {together}")


def mixed(r):
    """A structure of every kind of leaf one gather sends as one buffer: several dtypes, a scalar, a strided view."""
    return {
        "flags": torch.tensor([r == 0, True]),
        "ids": torch.arange(3) + 10 * r,
        "half": torch.full((2, 2), r + 0.5, dtype=torch.float16),
        "scalar": torch.tensor(float(r), dtype=torch.float64),
        "view": torch.arange(12.0).view(3, 4)[:, 1] + r,
    }


got = gather(mixed(rank))
expected = {
    key: torch.cat([mixed(r)[key].reshape(-1) if mixed(r)[key].ndim == 0 else mixed(r)[key] for r in (0, 1)])
    for key in mixed(0)
}
wrong = [key for key in expected if got[key].dtype != expected[key].dtype or not torch.equal(got[key], expected[key])]
if wrong:
    sys.exit(f"rank {rank}: the gather of mixed dtypes differs from the per-tensor result at {wrong}: {got}")
print(f"rank {rank}: {len(checked)} mismatches raised on this rank: {', '.join(checked)}", flush=True)
