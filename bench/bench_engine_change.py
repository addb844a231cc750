"""Resume under another engine against a resume under the same one: ``load_state`` time, side by side.

A model of N blocks (Linear 1024->4096 + GELU + Linear 4096->1024, 8.4M parameters each; 3 blocks: 25.2M) with AdamW
in fp32 takes one step and is saved by ``save_state`` on 2 processes (gloo, CPU) under each engine: DDP, FSDP2
(``SHARDED_STATE_DICT``) and ZeRO-2 (DeepSpeed on the CPU). Then one worker per target engine, on 2 processes, runs
its contestants alternately (A B C ..., then in reverse) for ``--rounds`` rounds, each timed around one call (after a
barrier, on the main process, until a barrier after it):

* ``same``: ``load_state`` of the target's own checkpoint (the same layout);
* ``from <engine>``: ``load_state`` of each other engine's checkpoint (read by parameter name, then laid out for the
  target);
* ``floor <engine>``: every process reads every file of that engine's checkpoint into memory once (one pass over
  the saved state, the least any resume that reads it whole can cost).

Issue 32 item 4 asks that re-partitioning costs at most one extra pass over the optimizer state: ``(from - same)``
is printed against the source's ``floor``, per round (at most 1.0 meets it). Accelerate cannot resume a checkpoint
under another engine, so its figure (with the reference copy) is its same-layout resume on the target engine; it
does not run FSDP on the CPU (its FSDP needs a GPU distributed type), so FSDP2 has no Accelerate figure.

``--busy N`` runs N busy processes (a CPU-bound loop each) beside the whole run.

Usage: python bench/bench_engine_change.py [--rounds 5] [--blocks 3] [--no-accelerate] [--busy 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    ROOT,
    BusyProcesses,
    block_model,
    describe,
    free_port,
    paired_ratio_range,
    reference_accelerate,
    round_order,
)  # noqa: E402

ENGINES = ("ddp", "fsdp2", "zero2")
ACCELERATE_ENGINES = ("ddp", "zero2")  # Accelerate 1.15 runs FSDP only on accelerators
PROCESSES = 2


def _accelerator(engine: str):
    """An Accelerator for ``engine`` on this launch's processes, from whichever ``accelerate`` the path gives."""
    from accelerate import Accelerator, DeepSpeedPlugin, FullyShardedDataParallelPlugin

    if engine == "ddp":
        return Accelerator(cpu=True)
    if engine == "fsdp2":
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
        return Accelerator(cpu=True, fsdp_plugin=plugin)
    plugin = DeepSpeedPlugin(zero_stage=2, gradient_clipping=1e6)
    plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 2
    plugin.deepspeed_config["train_batch_size"] = 2 * int(os.environ["WORLD_SIZE"])
    return Accelerator(deepspeed_plugin=plugin)


def _prepared(engine: str, blocks: int):
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    accelerator = _accelerator(engine)
    raw = block_model(blocks)
    optimizer = torch.optim.AdamW(raw.parameters(), lr=1e-4)
    loader = DataLoader(TensorDataset(torch.randn(8, 1024)), batch_size=2)
    model, optimizer, _ = accelerator.prepare(raw, optimizer, loader)
    return accelerator, model, optimizer


def _read_every_file(folder: Path) -> None:
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            path.read_bytes()


def _contestants(accelerator, engine: str, root: Path, side: str) -> dict:
    if side == "accelerate":
        return {"accelerate": lambda: accelerator.load_state(str(root / f"accelerate_{engine}"))}
    contestants = {"same": lambda: accelerator.load_state(str(root / engine))}
    for source in ENGINES:
        if source != engine:
            contestants[f"from {source}"] = lambda s=source: accelerator.load_state(str(root / s))
            contestants[f"floor {source}"] = lambda s=source: _read_every_file(root / s)
    return contestants


def _timed(contestants: dict, rounds: int) -> dict[str, list[float]]:
    import torch.distributed as dist

    samples = {name: [] for name in contestants}
    for index in range(rounds):
        for name in round_order(list(contestants), index):
            dist.barrier()
            start = time.perf_counter()
            contestants[name]()
            dist.barrier()
            samples[name].append(time.perf_counter() - start)
    return samples


def worker(action: str, root: Path, engine: str, blocks: int, rounds: int, side: str) -> None:
    """Run under torchrun: ``save`` writes the ``engine`` checkpoint (``root/<engine>``, or
    ``root/accelerate_<engine>`` for Accelerate); ``load`` times the contestants under ``engine``."""
    import torch

    warnings.simplefilter("ignore")
    accelerator, model, optimizer = _prepared(engine, blocks)
    if action == "save":
        loss = model(torch.randn(2, 1024)).square().mean()
        accelerator.backward(loss)
        optimizer.step()
        accelerator.save_state(str(root / (f"accelerate_{engine}" if side == "accelerate" else engine)))
        return
    samples = _timed(_contestants(accelerator, engine, root, side), rounds)
    if accelerator.is_main_process:
        (root / f"result_{side}_{engine}.json").write_text(json.dumps(samples))


def _launch(side: str, *args: str) -> None:
    path = [str(ROOT / "src" / "hasten" / "_accelerate_shim"), str(ROOT / "src")]
    if side == "accelerate":
        path = [str(reference_accelerate())]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("ACCELERATE_USE_CPU", None)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(PROCESSES)]
    command += ["--master_addr", "127.0.0.1", "--master_port", str(free_port()), __file__, "--worker", *args]
    command += ["--side", side]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"worker failed ({' '.join(args)}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")


def _size(folder: Path) -> float:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file()) / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--no-accelerate", action="store_true")
    parser.add_argument(
        "--busy", type=int, default=0, help="busy processes (a CPU-bound loop each) running beside the whole run"
    )
    parser.add_argument("--worker", nargs=3, metavar=("ACTION", "ROOT", "ENGINE"), help=argparse.SUPPRESS)
    parser.add_argument("--side", default="hasten", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        action, root, engine = args.worker
        worker(action, Path(root), engine, args.blocks, args.rounds, args.side)
        return
    sides = ["hasten"] + ([] if args.no_accelerate or reference_accelerate() is None else ["accelerate"])
    print(
        f"{args.blocks * 8.4:.1f}M parameters, AdamW fp32, {PROCESSES} processes (gloo), {args.rounds} rounds; "
        f"{args.busy} busy process(es) beside the run"
    )
    print("load average at start: " + " ".join(f"{value:.2f}" for value in os.getloadavg()))
    with BusyProcesses(args.busy), tempfile.TemporaryDirectory(prefix="bench-engine-change-") as tmp:
        root = Path(tmp)
        common = ["--blocks", str(args.blocks), "--rounds", str(args.rounds)]
        for engine in ENGINES:
            _launch("hasten", "save", str(root), engine, *common)
        if "accelerate" in sides:
            for engine in ACCELERATE_ENGINES:
                _launch("accelerate", "save", str(root), engine, *common)
                _launch("accelerate", "load", str(root), engine, *common)
        for engine in ENGINES:
            _launch("hasten", "load", str(root), engine, *common)
        _report(root, sides)
    print("load average at end: " + " ".join(f"{value:.2f}" for value in os.getloadavg()))


def _report(root: Path, sides: list[str]) -> None:
    print("checkpoints: " + ", ".join(f"{engine} {_size(root / engine):.0f} MB" for engine in ENGINES))
    extras = []
    for engine in ENGINES:
        samples = json.loads((root / f"result_hasten_{engine}.json").read_text())
        print(f"load_state under {engine} on {PROCESSES} processes:")
        print("  " + describe(f"same ({engine}->{engine})", samples["same"]))
        sources = [source for source in ENGINES if source != engine]
        for source in sources:
            print("  " + describe(f"from {source} ({source}->{engine})", samples[f"from {source}"]))
        for source in sources:
            print("  " + describe(f"floor: read every file of the {source} checkpoint", samples[f"floor {source}"]))
        if "accelerate" in sides and engine in ACCELERATE_ENGINES:
            theirs = json.loads((root / f"result_accelerate_{engine}.json").read_text())["accelerate"]
            print("  " + describe(f"accelerate 1.15 same ({engine}->{engine})", theirs))
        for source in sources:
            cross, same, floor = samples[f"from {source}"], samples["same"], samples[f"floor {source}"]
            ratio = paired_ratio_range(cross, same)
            print(f"  from {source}/same: median {ratio[0]:.2f} (min-max {ratio[1]:.2f}-{ratio[2]:.2f})")
            extra = [a - b for a, b in zip(cross, same)]
            ratio = paired_ratio_range(extra, floor)
            line = f"  (from {source} - same)/floor: median {ratio[0]:.2f} (min-max {ratio[1]:.2f}-{ratio[2]:.2f})"
            print(line + (" (target <= 1: met)" if ratio[0] <= 1 else " (target <= 1: missed)"))
            extras.append(f"{source}->{engine} {ratio[0]:.2f}")
    print(f"ratio (cross - same)/floor, medians (target <= 1): {', '.join(extras)}")


if __name__ == "__main__":
    main()
