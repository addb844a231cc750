"""Peak memory of running a model whose weights are larger than the CPU budget, with disk offload.

Two steps, each in its own process so that the measuring process never held the whole model:

    python big_model_rss.py save DIR --blocks 16 --width 1024     # writes a sharded checkpoint + expected output
    python big_model_rss.py run DIR --budget-mb 32                # loads with max_memory={"cpu": budget}, runs

``run`` prints one JSON line: the weights' size, the budget, one block's size, the RSS before loading
(baseline) and the peak RSS (``VmHWM``, reset at the baseline) while loading and running, the limit
``(budget + block) * 1.2`` above the baseline, and the largest difference from the expected output.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import psutil
import torch
from torch import nn

MB = 2**20


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up = nn.Linear(width, width)
        self.down = nn.Linear(width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x))) / x.shape[-1]


class Tower(nn.Module):
    def __init__(self, blocks: int, width: int):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _save(folder: Path, blocks: int, width: int) -> None:
    from hasten.big_modeling.serialization import save_model_weights

    torch.manual_seed(0)
    model = Tower(blocks, width)
    inputs = torch.randn(4, width)
    with torch.no_grad():
        expected = model(inputs)
    save_model_weights(model.state_dict(), folder / "checkpoint", max_shard_size=f"{3 * width * width * 4}B")
    torch.save({"inputs": inputs, "expected": expected, "blocks": blocks, "width": width}, folder / "expected.pt")


def _reset_peak_rss() -> None:
    """Start the peak-RSS count from now (Linux: clear_refs 5 resets VmHWM)."""
    clear = Path("/proc/self/clear_refs")
    if clear.exists():
        clear.write_text("5")


def _peak_rss() -> int:
    """Peak RSS in bytes since :func:`_reset_peak_rss` (VmHWM), or since the start elsewhere."""
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # bytes on macOS


def _run(folder: Path, budget_mb: float) -> dict:
    from hasten.big_modeling import init_empty_weights, load_checkpoint_and_dispatch
    from hasten.big_modeling.device_map import device_for
    from hasten.big_modeling.modeling import compute_module_sizes

    reference = torch.load(folder / "expected.pt", weights_only=True)
    with init_empty_weights():
        model = Tower(reference["blocks"], reference["width"])
    sizes = compute_module_sizes(model)
    _reset_peak_rss()
    baseline = psutil.Process().memory_info().rss
    start = time.perf_counter()
    model = load_checkpoint_and_dispatch(
        model,
        folder / "checkpoint",
        device_map="auto",
        max_memory={"cpu": int(budget_mb * MB)},
        no_split_module_classes=["Block"],
        offload_folder=folder / "offload",
    )
    loaded = time.perf_counter()
    with torch.no_grad():
        output = model(reference["inputs"])
    ran = time.perf_counter()
    peak = _peak_rss()
    block = sizes["blocks.0"]
    placement = [device_for(f"blocks.{index}", model.hf_device_map) for index in range(reference["blocks"])]
    return {
        "weights_mb": round(sizes[""] / MB, 1),
        "budget_mb": budget_mb,
        "block_mb": round(block / MB, 1),
        "blocks_on_cpu": placement.count("cpu"),
        "blocks_on_disk": placement.count("disk"),
        "offload_folder_files": sorted(path.name for path in (folder / "offload").iterdir()),
        "baseline_mb": round(baseline / MB, 1),
        "peak_mb": round(peak / MB, 1),
        "peak_over_baseline_mb": round((peak - baseline) / MB, 1),
        "limit_mb": round((budget_mb * MB + block) * 1.2 / MB, 1),
        "max_abs_diff": float((output - reference["expected"]).abs().max()),
        "load_s": round(loaded - start, 3),
        "forward_s": round(ran - loaded, 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=["save", "run"])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--budget-mb", type=float, default=32.0)
    args = parser.parse_args(argv)
    args.folder.mkdir(parents=True, exist_ok=True)
    if args.step == "save":
        _save(args.folder, args.blocks, args.width)
        return 0
    print(json.dumps(_run(args.folder, args.budget_mb)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
