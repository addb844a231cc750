"""Import cost of hasten over ``import torch``, and the wall time of ``hasten --help``, side by side.

Each command runs in a fresh interpreter (so every import is paid in full; the files themselves are
in the page cache after the first run, hence "cold-ish"), the commands alternating run by run. For each
the script prints the median wall time with min-max, then the time each adds over ``import torch``
(difference of medians) and the ``hasten --help`` wall time last.

``import hasten`` is lazy (it imports neither torch nor any submodule), so the figure that matters is
``from hasten import Accelerator``: what a training script pays. ``import torch`` alone varies by
tenths of a second between runs on a busy machine, more than the difference being measured, so the
script also times the import inside each interpreter right after ``import torch`` ("in-process
increment", median of the runs): the cost over torch without torch's own noise. Optional packages
that ``import hasten`` and ``from hasten import Accelerator`` pulled in are listed (there should be
none). When ``accelerate`` is importable it is measured the same way.

Usage: python bench/bench_import.py [--runs 7]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import accelerate_available, describe, round_order, worker_environment  # noqa: E402

OPTIONAL = (
    "deepspeed",
    "tensorboard",
    "wandb",
    "mlflow",
    "transformers",
    "questionary",
    "pexpect",
    "sklearn",
    "tqdm",
    "psutil",
    "yaml",
    "safetensors",
    "torchao",
    "comet_ml",
    "aim",
    "clearml",
    "dvclive",
    "swanlab",
    "trackio",
)
_CHECK = "import sys; {statement}; print(','.join(sorted(m for m in {optional!r} if m in sys.modules)))"
_INCREMENT = "import time, torch; start = time.perf_counter(); {statement}; print(time.perf_counter() - start)"


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def _hasten_cli() -> list[str]:
    script = Path(sys.executable).with_name("hasten")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "hasten.commands.main"]


def _time(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(
        command,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=worker_environment(PYTHONDONTWRITEBYTECODE="1"),  # HuggingFace's Accelerate first, not the alias
    )
    return time.perf_counter() - start


def _optional_imports(statement: str) -> list[str]:
    out = subprocess.run(
        _python(_CHECK.format(statement=statement, optional=OPTIONAL)), check=True, capture_output=True, text=True
    ).stdout.strip()
    return [name for name in out.split(",") if name]


def _increment(statement: str) -> float:
    """Seconds ``statement`` takes in a fresh interpreter that has already imported torch."""
    code = _INCREMENT.format(statement=statement)
    return float(
        subprocess.run(_python(code), check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
    )


def main() -> None:
    """Time the commands alternately and print medians, differences over torch, and the CLI time last."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=7, help="timed runs of each command (after one warm-up each)")
    args = parser.parse_args()
    commands = {
        "python (empty)": _python("pass"),
        "import torch": _python("import torch"),
        "import hasten": _python("import hasten"),
        "from hasten import Accelerator": _python("from hasten import Accelerator"),
        "hasten --help": [*_hasten_cli(), "--help"],
    }
    if accelerate_available():
        commands["import accelerate"] = _python("import accelerate")
        commands["from accelerate import Accelerator"] = _python("from accelerate import Accelerator")
    for command in commands.values():
        _time(command)
    times: dict[str, list[float]] = {name: [] for name in commands}
    for run in range(args.runs):
        for name in round_order(list(commands), run):
            times[name].append(_time(commands[name]))
        print(f"run {run + 1}: " + "  ".join(f"{name} {times[name][-1]:.3f}" for name in commands), flush=True)
    print()
    for name, samples in times.items():
        print(describe(name, samples))
    by_torch = _optional_imports("import torch")
    for statement in ("import hasten", "from hasten import Accelerator"):
        extra = sorted(set(_optional_imports(statement)) - set(by_torch))
        print(f"optional packages imported by `{statement}` (beyond those torch imports): {', '.join(extra) or 'none'}")
    torch_median = statistics.median(times["import torch"])
    for name in commands:
        if name.startswith(("import", "from")) and name != "import torch":
            print(
                f"{name}: difference of medians over import torch: "
                f"{statistics.median(times[name]) - torch_median:+.3f} s"
            )
    for name in commands:
        if name.startswith(("import", "from")) and name != "import torch":
            increments = [_increment(name) for _ in range(args.runs)]
            print(
                f"{name} adds over import torch (in-process increment): {statistics.median(increments):.3f} s "
                f"(min-max {min(increments):.3f}-{max(increments):.3f}; target <= 0.15 s)"
            )
    print(f"hasten --help wall time: {statistics.median(times['hasten --help']):.3f} s (target < 0.5 s)")


if __name__ == "__main__":
    main()
