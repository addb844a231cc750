"""Checkpoint throughput: ``save_state``/``load_state`` vs the raw safetensors floor, side by side.

A ~100M-parameter model (12 blocks of LayerNorm + Linear 1024->4096 + GELU + Linear 4096->1024) with
AdamW state (one step taken, so ``exp_avg``/``exp_avg_sq`` exist): ~1.2 GB of tensors.

* raw save: ``safetensors.torch.save_file`` of the same tensors (model + optimizer state flattened
  into one dict) followed by ``fsync`` of the file (hasten's save is durable, so the floor must be too).
* raw load: ``safetensors.torch.load_file`` (a lazy memory map) and copying every tensor into the live
  model (``load_state_dict``) and into the live optimizer state, so that every byte is really read.
* hasten: ``Accelerator.save_state(folder)`` / ``load_state(folder)`` (checksums, manifest, atomic rename).
* accelerate, when importable: its ``save_state`` / ``load_state`` (no fsync, pickled optimizer).

Rounds alternate the contestants (A B, then B A). Every save goes to a folder under ``outputs/`` (the
repository's disk) that was deleted beforehand. Page cache: before each load the checkpoint's files
are synced and evicted from the page cache with ``posix_fadvise(POSIX_FADV_DONTNEED)`` (``--cache
cold``, the default), so every load reads from the disk; ``--cache warm`` loads straight after the
save instead, from memory. Before each load the model and optimizer state are overwritten with zeros,
and after it they are compared with the saved values (untimed), so a load that skipped data fails.
Throughput is checkpoint tensor bytes / seconds; the ratios hasten/raw of throughput come last (of
the medians, with the spread of the per-round ratios, and of the fastest runs: on a shared machine
interference only ever slows a run down, so the fastest runs show what each contestant can do).

Usage: python bench/bench_checkpoint.py [--rounds 5] [--cache cold|warm] [--blocks 12]
"""

from __future__ import annotations

import argparse
import copy as copy_module
import os
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import describe, has_module, paired_ratio_range, ratio_of_medians, round_order  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent / "outputs" / "bench_checkpoint"
WIDTH = 1024


def _model(blocks: int) -> torch.nn.Module:
    layers = []
    for _ in range(blocks):
        layers += [torch.nn.LayerNorm(WIDTH), torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.GELU(), torch.nn.Linear(4 * WIDTH, WIDTH)]
    return torch.nn.Sequential(*layers)


def _optimizer_tensors(optimizer) -> dict[str, torch.Tensor]:
    """The optimizer's state tensors, keyed ``optimizer.<param index>.<name>``."""
    index = {id(p): i for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"])}
    return {f"optimizer.{index[id(p)]}.{name}": value for p, state in optimizer.state.items() for name, value in state.items()}


def _all_tensors(model, optimizer) -> dict[str, torch.Tensor]:
    return {**{f"model.{k}": v for k, v in model.state_dict().items()}, **_optimizer_tensors(optimizer)}


def _evict(folder: Path) -> None:
    """Sync every file of ``folder`` and drop its pages from the page cache."""
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


class Raw:
    """``safetensors.torch.save_file`` + fsync; ``load_file`` + copy into the model and optimizer."""

    name = "raw"

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def save(self, folder: Path) -> None:
        from safetensors.torch import save_file

        folder.mkdir(parents=True)
        path = folder / "checkpoint.safetensors"
        save_file(_all_tensors(self.model, self.optimizer), path)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def load(self, folder: Path) -> None:
        from safetensors.torch import load_file

        loaded = load_file(folder / "checkpoint.safetensors")
        self.model.load_state_dict({k.removeprefix("model."): v for k, v in loaded.items() if k.startswith("model.")})
        with torch.no_grad():
            for name, tensor in _optimizer_tensors(self.optimizer).items():
                tensor.copy_(loaded[name])


class Framework:
    """``Accelerator.save_state`` / ``load_state`` of hasten or accelerate."""

    def __init__(self, name: str, accelerator, model, optimizer):
        self.name, self.accelerator = name, accelerator
        self.model, self.optimizer = model, optimizer

    def save(self, folder: Path) -> None:
        self.accelerator.save_state(str(folder))

    def load(self, folder: Path) -> None:
        self.accelerator.load_state(str(folder))


def _contestants(blocks: int) -> tuple[list, dict[str, torch.Tensor]]:
    """Each contestant gets its own model and optimizer, all starting from the same state."""
    torch.manual_seed(0)
    base = _model(blocks)
    optimizer = torch.optim.AdamW(base.parameters(), lr=1e-4)
    base(torch.randn(4, WIDTH)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    reference = {k: v.clone() for k, v in _all_tensors(base, optimizer).items()}

    def copy():
        model = _model(blocks)
        model.load_state_dict(base.state_dict())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        opt.load_state_dict(copy_module.deepcopy(optimizer.state_dict()))  # own tensors, not shared with `base`
        return model, opt

    contestants = [Raw(base, optimizer)]
    import hasten

    accelerator = hasten.Accelerator()
    model, opt = copy()
    model, opt = accelerator.prepare(model, opt)
    contestants.append(Framework("hasten", accelerator, model, opt))
    if has_module("accelerate"):
        import accelerate

        accelerator = accelerate.Accelerator(cpu=True)
        model, opt = copy()
        model, opt = accelerator.prepare(model, opt)
        contestants.append(Framework("accelerate", accelerator, model, opt))
    return contestants, reference


def _scramble(contestant) -> None:
    with torch.no_grad():
        for tensor in _all_tensors(contestant.model, contestant.optimizer).values():
            tensor.zero_()


def _check(contestant, reference: dict[str, torch.Tensor]) -> None:
    current = _all_tensors(contestant.model, contestant.optimizer)
    for name, expected in reference.items():
        if not torch.equal(current[name], expected):
            raise SystemExit(f"{contestant.name}: {name} differs from the saved value after load.")


def _timed(function, folder: Path) -> float:
    start = time.perf_counter()
    function(folder)
    return time.perf_counter() - start


def main() -> None:
    """Run the rounds and print throughput medians with min-max, the ratios to raw last."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per contestant (after one warm-up round)")
    parser.add_argument("--cache", choices=["cold", "warm"], default="cold", help="evict the files from the page cache before loading (cold) or not (warm)")
    parser.add_argument("--blocks", type=int, default=12, help="model blocks of 8.4M parameters each (12: ~100M)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    contestants, reference = _contestants(args.blocks)
    params = sum(v.numel() for k, v in reference.items() if k.startswith("model."))
    nbytes = sum(v.numel() * v.element_size() for v in reference.values())
    print(f"model: {params / 1e6:.1f}M parameters; checkpoint tensors (model + AdamW state): {nbytes / 1e9:.3f} GB; page cache: {args.cache}")
    names = [c.name for c in contestants]
    by_name = {c.name: c for c in contestants}
    saves: dict[str, list[float]] = {name: [] for name in names}
    loads: dict[str, list[float]] = {name: [] for name in names}
    shutil.rmtree(ROOT, ignore_errors=True)
    try:
        for round_index in range(-1, args.rounds):  # round -1 warms every contestant up, untimed
            for name in round_order(names, max(round_index, 0)):
                contestant, folder = by_name[name], ROOT / name
                shutil.rmtree(folder, ignore_errors=True)
                os.sync()
                save = _timed(contestant.save, folder)
                if args.cache == "cold":
                    _evict(folder)
                _scramble(contestant)
                load = _timed(contestant.load, folder)
                _check(contestant, reference)
                shutil.rmtree(folder)
                if round_index >= 0:
                    saves[name].append(save)
                    loads[name].append(load)
            if round_index >= 0:
                print(f"round {round_index + 1}: " + "  ".join(f"{n} save {saves[n][-1]:.2f} s load {loads[n][-1]:.2f} s" for n in names), flush=True)
    finally:
        shutil.rmtree(ROOT, ignore_errors=True)
    print()
    for kind, times in (("save", saves), ("load", loads)):
        for name in names:
            print(describe(f"{kind} {name:10s}", [nbytes / t / 1e9 for t in times[name]], "GB/s"))
    for kind, times, target in (("save", saves, 0.9), ("load", loads, 0.95)):
        for name in names[1:]:
            median, low, high = paired_ratio_range(times["raw"], times[name])
            print(
                f"{kind} throughput ratio {name}/raw: {ratio_of_medians(times['raw'], times[name]):.3f} "
                f"(per-round median {median:.3f}, min-max {low:.3f}-{high:.3f}; fastest runs {min(times['raw']) / min(times[name]):.3f}; target >= {target})"
            )


if __name__ == "__main__":
    main()
