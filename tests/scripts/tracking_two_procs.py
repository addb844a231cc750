"""Two processes, one TrackerHub each: only rank 0 writes TensorBoard and JSON lines files.

Run with ``python -m torch.distributed.run --nproc_per_node 2 --master_port <free> tracking_two_procs.py LOGDIR``.
Every rank logs rank-specific values (``loss = step + 0.25 + 100 * rank``), so the files prove whose
values were written; tests/tracking/test_tracking.py reads them back. Exits non-zero on the first failed check.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from hasten.state import PartialState
from hasten.tracking import BlankTracker, GeneralTracker, TrackerHub, on_main_process

STEPS = 5


class EveryRankTracker(GeneralTracker):
    """Runs on every process and writes what it saw to ``everyrank_<rank>.json``."""

    name = "everyrank"
    requires_logging_directory = False
    main_process_only = False

    def __init__(self, path: str):
        super().__init__()
        self.path = path
        self.records: list = []

    @property
    def tracker(self):
        return self.records

    def log(self, values, step=None, **kwargs):
        self.records.append({"step": step, "values": values})

    def finish(self):
        with open(self.path, "w", encoding="utf-8") as handle:
            json.dump(self.records, handle)


class MainOnlyTracker(GeneralTracker):
    """A main-process tracker whose decorated ``log`` must do nothing when called directly on rank 1."""

    name = "mainonly"
    requires_logging_directory = False

    def __init__(self):
        super().__init__()
        self.calls = 0

    @property
    def tracker(self):
        return self.calls

    @on_main_process
    def log(self, values, step=None, **kwargs):
        self.calls += 1


def check(condition: bool, message: str) -> None:
    if not condition:
        print(f"[rank {PartialState().process_index}] FAILED: {message}", file=sys.stderr, flush=True)
        sys.exit(1)


def main(logging_dir: str) -> None:
    state = PartialState()
    rank = state.process_index
    check(state.num_processes == 2, f"expected 2 processes, got {state.num_processes}")
    every_rank = EveryRankTracker(os.path.join(logging_dir, f"everyrank_{rank}.json"))
    main_only = MainOnlyTracker()
    hub = TrackerHub(
        ["tensorboard", "jsonl", every_rank, main_only], logging_dir, is_main_process=state.is_main_process
    )
    hub.init("two_procs", config={"lr": torch.tensor(0.125), "world_size": state.num_processes})

    names = sorted(tracker.name for tracker in hub.trackers)
    expected = ["everyrank", "jsonl", "mainonly", "tensorboard"] if rank == 0 else ["everyrank"]
    check(names == expected, f"rank {rank} runs {names}, expected {expected}")

    for step in range(STEPS):
        loss = torch.tensor(step + 0.25 + 100 * rank)
        hub.log({"loss": loss, "acc": step / 10 + rank, "phase": f"rank{rank}"}, step=step)

    main_only.log({"x": 1})  # called directly: runs on rank 0 only
    check(main_only.calls == (STEPS + 1 if rank == 0 else 0), f"mainonly saw {main_only.calls} calls on rank {rank}")
    writer = hub.get("tensorboard", unwrap=True)
    if rank == 0:
        check(type(writer).__name__ == "SummaryWriter", f"rank 0 got {writer!r} for the tensorboard writer")
    else:
        check(isinstance(writer, BlankTracker), f"rank 1 got {writer!r} instead of a blank tracker")
        writer.add_scalar("never", 1.0, 0)  # a no-op on the blank tracker
        check(isinstance(hub.get("jsonl"), BlankTracker), "rank 1 must get a blank jsonl tracker")
    check(hub.get("everyrank") is every_rank, "every rank must get its own everyrank tracker")
    hub.finish()
    dist.barrier()
    state.destroy_process_group()
    print(f"[rank {rank}] tracking checks passed", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
