"""Run every benchmark, one after the other, and end with a summary of their ratios to raw PyTorch.

Each benchmark is a script of its own (``python bench/bench_<name>.py``) that runs its contestants
side by side; this script runs them in turn, shows their output as it comes, and repeats the lines
that state a ratio or a target at the end. ``make bench`` calls it.

Usage: python bench/run_all.py [--only import launch step checkpoint gpu engine-change] [--quick]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# name -> (script, arguments for --quick)
BENCHMARKS = {
    "import": ("bench_import.py", ["--runs", "3"]),
    "launch": ("bench_launch.py", ["--runs", "3"]),
    "step": ("bench_step.py", ["--rounds", "3", "--steps", "100"]),
    "checkpoint": ("bench_checkpoint.py", ["--rounds", "2"]),
    "gpu": ("bench_gpu_lm.py", ["--rounds", "2", "--steps", "10"]),
    "engine-change": ("bench_engine_change.py", ["--rounds", "2", "--blocks", "1"]),
}
_SUMMARY = re.compile(
    r"^(ratio |save throughput|load throughput|.* adds over import torch|hasten --help wall time|optional "
    r"packages|bench_gpu_lm: )"
)


def _run(name: str, quick: bool) -> tuple[int, list[str]]:
    script, quick_args = BENCHMARKS[name]
    command = [sys.executable, str(HERE / script), *(quick_args if quick else [])]
    print(f"\n=== {name}: {' '.join(command[1:])}", flush=True)
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    kept = []
    for line in process.stdout:
        print(line, end="", flush=True)
        if _SUMMARY.match(line):
            kept.append(line.rstrip())
    code = process.wait()
    print(
        f"=== {name}: {'done' if code == 0 else f'FAILED (exit {code})'} in {time.perf_counter() - start:.0f} s",
        flush=True,
    )
    return code, kept


def main() -> None:
    """Run the chosen benchmarks and print the summary; exit non-zero if any benchmark failed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--only", nargs="+", choices=list(BENCHMARKS), default=list(BENCHMARKS), help="benchmarks to run (default: all)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="fewer rounds: checks that everything runs, with wide noise"
    )
    args = parser.parse_args()
    summary, failed = [], []
    for name in args.only:
        code, kept = _run(name, args.quick)
        summary += [f"[{name}] {line}" for line in kept]
        if code != 0:
            failed.append(name)
    print("\n=== summary (hasten vs raw PyTorch; targets in bench/README.md)")
    print("\n".join(summary))
    if failed:
        raise SystemExit(f"benchmarks that failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
