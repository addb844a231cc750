"""Per-collective cost of hasten's ``gather``/``reduce`` (hang watchdog always on) against raw ``torch.distributed``.

Run ``python bench/bench_collectives.py``: it starts itself on 2 processes under torchrun (gloo, 1
thread each). Each round times ``--calls`` calls of every contestant, alternating the order between
rounds; printed are the median microseconds per call with the min-max spread and the ratio of
medians hasten/raw, for a 1-element tensor (latency-bound: any fixed overhead shows) and a 64k-float
tensor (a typical metrics gather), then the cost of the watchdog's record alone (enter + leave), which
is all the watchdog adds to a collective.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import describe, free_port, paired_ratio_range, ratio_of_medians, round_order  # noqa: E402

SIZES = {"1 float": 1, "64k floats": 65536}


def _contestants():
    import torch
    import torch.distributed as dist

    from hasten.runtime.operations import gather, reduce

    world = dist.get_world_size()

    def raw_gather(t):
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t)
        return torch.cat(parts)

    def raw_reduce(t):
        out = t.clone()
        dist.all_reduce(out)
        return out / world

    return {
        "gather": {"raw": raw_gather, "hasten": gather},
        "reduce": {"raw": raw_reduce, "hasten": lambda t: reduce(t, "mean")},
    }


def worker(args) -> None:
    """Time every contestant in this process and write rank 0's samples as JSON."""
    import torch
    import torch.distributed as dist

    from hasten import PartialState

    torch.set_num_threads(1)
    state = PartialState()
    results: dict = {}
    for op, contestants in _contestants().items():
        for label, numel in SIZES.items():
            tensor = torch.full((numel,), float(state.process_index))
            samples: dict[str, list[float]] = {name: [] for name in contestants}
            for round_index in range(-1, args.rounds):
                for name in round_order(list(contestants), max(round_index, 0)):
                    dist.barrier()
                    start = time.perf_counter()
                    for _ in range(args.calls):
                        contestants[name](tensor)
                    elapsed = time.perf_counter() - start
                    if round_index >= 0:
                        samples[name].append(elapsed / args.calls)
            results[f"{op} ({label})"] = samples
    results["watchdog record (enter + leave)"] = {"hasten": _record_cost()}
    if state.is_main_process:
        Path(args.output).write_text(json.dumps(results))


def _record_cost(calls: int = 200_000) -> list[float]:
    """Seconds per enter/leave pair of the hang watchdog: what every collective pays for it."""
    from hasten.runtime import hang_watchdog

    samples = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            hang_watchdog.enter("bench")
            hang_watchdog.leave()
        samples.append((time.perf_counter() - start) / calls)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--output", default="")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    output = Path(args.output or "outputs/bench_collectives.json")
    output.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
               __file__, "--worker", "--rounds", str(args.rounds), "--calls", str(args.calls), "--output", str(output)]
    subprocess.run(command, env=env, check=True)
    results = json.loads(output.read_text())
    print(f"2 processes, gloo, {args.calls} calls/round, {args.rounds} rounds")
    for case, samples in results.items():
        for name, values in samples.items():
            print(describe(f"  {case:22s} {name:7s}", values, unit="us", scale=1e6, digits=3 if "record" in case else 1))
        if "raw" not in samples:
            continue
        fastest = min(samples["hasten"]) / min(samples["raw"])
        median, low, high = paired_ratio_range(samples["hasten"], samples["raw"])
        print(f"  {case:22s} hasten/raw: {ratio_of_medians(samples['hasten'], samples['raw']):.3f} (per-round {low:.3f}-{high:.3f}; fastest rounds {fastest:.3f})")


if __name__ == "__main__":
    main()
