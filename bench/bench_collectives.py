"""Per-call cost of hasten's ``gather``/``reduce`` (hang watchdog and input check on) against raw torch.distributed.

Run ``python bench/bench_collectives.py``: it starts itself on 2 processes under torchrun (gloo, 1
thread each). Each round times ``--calls`` calls of every contestant, alternating the order between
rounds; printed are the median microseconds per call with the min-max spread and the ratio of
medians hasten/raw, for a 1-element tensor (latency-bound: any fixed overhead shows), a 64k-float
tensor (a typical metrics gather) and a pair of 32x256 tensors (``gather_for_metrics((predictions,
labels))``, which raw PyTorch gathers one by one and hasten in one buffer). Every hasten call is checked
(:mod:`hasten.runtime.collective_check`): a payload of at most 64 KiB repeated with the same size travels
inside the check's one all-gather, a larger one after it. HuggingFace's Accelerate is a third contestant when
the workers can import it (the repository's reference copy, ``--accelerate-path``). Then, in one process, the
cost of the watchdog's record (enter + leave) and of computing the header's digest.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    describe,
    free_port,
    paired_ratio_range,
    ratio_of_medians,
    real_accelerate,
    round_order,
    worker_environment,
)

SIZES = {"1 float": 1, "64k floats": 65536}
PAIR = {"2 x 32x256 floats": 32 * 256}


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

    def raw_gather_pair(pair):
        return tuple(raw_gather(t) for t in pair)

    gathers = {"raw": raw_gather, "hasten": gather}
    reduces = {"raw": raw_reduce, "hasten": lambda t: reduce(t, "mean")}
    pairs = {"raw": raw_gather_pair, "hasten": gather}
    if real_accelerate() is not None:
        from accelerate import PartialState
        from accelerate.utils import gather as accelerate_gather
        from accelerate.utils import reduce as accelerate_reduce

        PartialState(cpu=True)  # joins the process group hasten created
        gathers["accelerate"] = pairs["accelerate"] = accelerate_gather
        reduces["accelerate"] = lambda t: accelerate_reduce(t, "mean")
    return {"gather": (gathers, SIZES), "reduce": (reduces, SIZES), "gather pair": (pairs, PAIR)}


def worker(args) -> None:
    """Time every contestant in this process and write rank 0's samples as JSON."""
    import torch
    import torch.distributed as dist

    from hasten import PartialState

    torch.set_num_threads(1)
    state = PartialState()
    results: dict = {}
    for op, (contestants, sizes) in _contestants().items():
        for label, numel in sizes.items():
            tensor = torch.full((numel,), float(state.process_index))
            if sizes is PAIR:
                tensor = (tensor.view(32, -1), tensor.view(32, -1).clone())
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
    results["header digest (1 tensor)"] = {"hasten": _digest_cost(torch.ones(32, 256))}
    results["header digest (dict of 4)"] = {"hasten": _digest_cost({k: torch.ones(32, 256) for k in "abcd"})}
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


def _digest_cost(data, calls: int = 50_000) -> list[float]:
    """Seconds to compute what a gather of ``data`` must agree on and its digest: the header's CPU cost."""
    from hasten.runtime import collective_check

    samples = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            collective_check.digest(collective_check.same_tensors(data))
        samples.append((time.perf_counter() - start) / calls)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--output", default="")
    parser.add_argument("--accelerate-path", help="folder holding HuggingFace's accelerate (default: .reference)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    output = Path(args.output or "outputs/bench_collectives.json")
    output.parent.mkdir(parents=True, exist_ok=True)
    env = worker_environment(args.accelerate_path, OMP_NUM_THREADS="1")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        __file__,
        "--worker",
        "--rounds",
        str(args.rounds),
        "--calls",
        str(args.calls),
        "--output",
        str(output),
    ]
    subprocess.run(command, env=env, check=True)
    results = json.loads(output.read_text())
    print(f"2 processes, gloo, {args.calls} calls/round, {args.rounds} rounds")
    for case, samples in results.items():
        for name, values in samples.items():
            digits = 3 if "raw" not in samples else 1
            print(describe(f"  {case:26s} {name:7s}", values, unit="us", scale=1e6, digits=digits))
        if "raw" not in samples:
            continue
        for name in [n for n in samples if n != "raw"]:
            fastest = min(samples[name]) / min(samples["raw"])
            median, low, high = paired_ratio_range(samples[name], samples["raw"])
            ratio = ratio_of_medians(samples[name], samples["raw"])
            print(
                f"  {case:26s} {name}/raw: {ratio:.3f} (per-round {low:.3f}-{high:.3f}; fastest rounds {fastest:.3f})"
            )


if __name__ == "__main__":
    main()
