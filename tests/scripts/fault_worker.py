"""A worker for the fault tests: joins the group, records its pid, then steps through all-reduces.

Usage: fault_worker.py OUT_DIR [--fail_rank R] [--fail_at STEP] [--how raise|kill|exit] [--steps N] [--step_seconds S]
Rank R fails at step STEP (raises, SIGKILLs itself, or exits with code 7); with ``--finish_rank R`` rank R leaves the
collective loop at once and ends successfully (the others then run their steps alone, without collectives).
"""

import argparse
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hasten import PartialState

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--fail_rank", type=int, default=-1)
parser.add_argument("--fail_at", type=int, default=3)
parser.add_argument("--how", default="raise")
parser.add_argument("--steps", type=int, default=600)
parser.add_argument("--step_seconds", type=float, default=0.1)
parser.add_argument("--solo", action="store_true", help="no collectives: each rank steps alone")
args = parser.parse_args()

state = PartialState()
rank = state.process_index
out = Path(args.out)
out.mkdir(parents=True, exist_ok=True)
(out / f"pid_rank{rank}").write_text(str(os.getpid()))
for step in range(max(args.steps, args.fail_at + 1) if rank == args.fail_rank else args.steps):
    if rank == args.fail_rank and step == args.fail_at:
        (out / "fail_time").write_text(repr(time.time()))
        if args.how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if args.how == "exit":
            os._exit(7)
        raise RuntimeError(f"rank {rank} fails on purpose at step {step}")
    if not args.solo:
        dist.all_reduce(torch.ones(1))
    time.sleep(args.step_seconds)
(out / f"done_rank{rank}").write_text("ok")
