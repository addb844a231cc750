"""ZeRO-2 resume on another number of processes against a resume on the same one: ``load_state`` time, side by side.

A model of N blocks (Linear 1024->4096 + GELU + Linear 4096->1024, 8.4M parameters each; 6 blocks: 50.4M) with
AdamW in fp32 under ZeRO-2 (DeepSpeed on the CPU, gloo) takes one step and is saved by ``save_state`` on 2 processes
and on 1. Then, in one worker per number of processes, the contestants alternate (A B, then B A) for ``--rounds``
rounds, each timed around ``load_state`` alone (after a barrier, on the main process):

* on 1 process: ``same`` loads the 1-process checkpoint (DeepSpeed's own load), ``resharded`` the 2-process one
  (read into full tensors per parameter name, then partitioned again), ``raw read`` is ``torch.load`` of every file
  of the 2-process checkpoint's engine folder (one pass over the saved state, the floor of any resume), and
  ``accelerate`` (with the reference copy) Accelerate 1.15's ``load_state`` of its own 1-process checkpoint;
* on 2 processes: ``same`` loads the 2-process checkpoint, ``resharded`` the 1-process one.

Accelerate cannot resume either checkpoint on the other number of processes (DeepSpeed refuses it), so its figure is
a same-layout one. Issue 32 item 4 asks that partitioning again costs at most one extra pass over the optimizer state:
``resharded - same`` is printed against ``raw read``.

Usage: python bench/bench_resharding.py [--rounds 5] [--blocks 6] [--no-accelerate]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import ROOT, block_model, describe, free_port, paired_ratio_range, reference_accelerate, round_order  # noqa: E402


def _prepared(blocks: int):
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    processes = int(os.environ["WORLD_SIZE"])
    plugin = DeepSpeedPlugin(zero_stage=2, gradient_clipping=1e6)
    plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 2
    plugin.deepspeed_config["train_batch_size"] = 2 * processes
    accelerator = Accelerator(deepspeed_plugin=plugin)
    raw = block_model(blocks)
    optimizer = torch.optim.AdamW(raw.parameters(), lr=1e-4)
    loader = DataLoader(TensorDataset(torch.randn(8, 1024)), batch_size=2)
    model, optimizer, _ = accelerator.prepare(raw, optimizer, loader)
    return accelerator, model, optimizer


def _raw_read(folder: Path) -> None:
    import torch

    for path in sorted((folder / "deepspeed" / "state").glob("*.pt")):
        torch.load(path, map_location="cpu", weights_only=False)


def worker(action: str, root: Path, blocks: int, rounds: int, side: str) -> None:
    """Run under torchrun: ``save`` writes ``root/<side>_w<processes>``; ``load`` times the contestants."""
    import torch
    import torch.distributed as dist

    accelerator, model, optimizer = _prepared(blocks)
    processes = int(os.environ["WORLD_SIZE"])
    if action == "save":
        loss = model(torch.randn(2, 1024)).square().mean()
        accelerator.backward(loss)
        optimizer.step()
        accelerator.save_state(str(root / f"{side}_w{processes}"))
        return
    other = 2 if processes == 1 else 1
    contestants = {
        "same": lambda: accelerator.load_state(str(root / f"{side}_w{processes}")),
        "resharded": lambda: accelerator.load_state(str(root / f"{side}_w{other}")),
    }
    if side == "accelerate":
        contestants = {"accelerate": contestants["same"]}
    elif processes == 1:
        contestants["raw read"] = lambda: _raw_read(root / f"{side}_w2")
    samples = {name: [] for name in contestants}
    for index in range(rounds):
        for name in round_order(list(contestants), index):
            if dist.is_initialized():
                dist.barrier()
            start = time.perf_counter()
            contestants[name]()
            if dist.is_initialized():
                dist.barrier()
            samples[name].append(time.perf_counter() - start)
    if accelerator.is_main_process:
        (root / f"result_{side}_{action}_w{processes}.json").write_text(json.dumps(samples))


def _launch(processes: int, side: str, *args: str) -> None:
    path = [str(ROOT / "src" / "hasten" / "_accelerate_shim"), str(ROOT / "src")]
    if side == "accelerate":
        path = [str(reference_accelerate())]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("ACCELERATE_USE_CPU", None)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes)]
    command += ["--master_addr", "127.0.0.1", "--master_port", str(free_port()), __file__, "--worker", *args]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"worker failed ({' '.join(args)}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--no-accelerate", action="store_true")
    parser.add_argument("--worker", nargs=2, metavar=("ACTION", "ROOT"), help=argparse.SUPPRESS)
    parser.add_argument("--side", default="hasten", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], Path(args.worker[1]), args.blocks, args.rounds, args.side)
        return
    sides = ["hasten"] + ([] if args.no_accelerate or reference_accelerate() is None else ["accelerate"])
    print(f"ZeRO-2, {args.blocks * 8.4:.1f}M parameters, AdamW fp32, {args.rounds} rounds")
    with tempfile.TemporaryDirectory(prefix="bench-resharding-") as tmp:
        root = Path(tmp)
        common = ["--blocks", str(args.blocks), "--rounds", str(args.rounds)]
        for processes in (2, 1):
            _launch(processes, "hasten", "save", str(root), *common)
        if "accelerate" in sides:
            _launch(1, "accelerate", "save", str(root), *common, "--side", "accelerate")
            _launch(1, "accelerate", "load", str(root), *common, "--side", "accelerate")
        for processes in (1, 2):
            _launch(processes, "hasten", "load", str(root), *common)
        _report(root, sides)


def _report(root: Path, sides: list[str]) -> None:
    for processes in (1, 2):
        samples = json.loads((root / f"result_hasten_load_w{processes}.json").read_text())
        other = 2 if processes == 1 else 1
        print(f"load_state on {processes} process(es):")
        print("  " + describe(f"same ({processes}->{processes})", samples["same"]))
        print("  " + describe(f"resharded ({other}->{processes})", samples["resharded"]))
        if "raw read" in samples:
            print("  " + describe("raw read (torch.load of the 2-process engine files)", samples["raw read"]))
        if processes == 1 and "accelerate" in sides:
            theirs = json.loads((root / "result_accelerate_load_w1.json").read_text())["accelerate"]
            print("  " + describe("accelerate 1.15 same (1->1)", theirs))
        ratio = paired_ratio_range(samples["resharded"], samples["same"])
        print(f"  resharded/same: median {ratio[0]:.2f} (min-max {ratio[1]:.2f}-{ratio[2]:.2f})")
        if "raw read" in samples:
            extra = [a - b for a, b in zip(samples["resharded"], samples["same"])]
            ratio = paired_ratio_range(extra, samples["raw read"])
            print(f"  (resharded - same)/raw read: median {ratio[0]:.2f} (min-max {ratio[1]:.2f}-{ratio[2]:.2f})")


if __name__ == "__main__":
    main()
