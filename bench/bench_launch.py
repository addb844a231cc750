"""Launch overhead of ``hasten launch`` against ``torchrun``, side by side.

Runs ``hasten launch --num_processes 2 noop.py`` and ``python -m torch.distributed.run
--nproc_per_node 2 noop.py`` alternately (so that machine load hits both alike), reports each wall
time, then per launcher the median and fastest wall time and the median CPU time of all its
processes, and prints the ratio of the median wall times hasten/torchrun last (target: at most 1.05).
On a shared machine the wall times vary from run to run; the CPU times vary much less.

Usage: python bench/bench_launch.py [--runs 7]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import accelerate_available, worker_environment  # noqa: E402


def _hasten_command() -> list[str]:
    script = Path(sys.executable).with_name("hasten")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "hasten.commands.main"]


def _time(command: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the launcher and every process it started)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    """Run the benchmark and print the table, the medians and the ratio."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=7, help="timed runs of each launcher (after one warm-up each)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        noop = Path(folder) / "noop.py"
        noop.write_text("")
        # no config file: every launcher starts from its defaults; HuggingFace's Accelerate first, not the alias
        env = worker_environment(HASTEN_HOME=folder, HF_HOME=folder)
        commands = {
            "hasten launch": [*_hasten_command(), "launch", "--num_processes", "2", str(noop)],
            "torchrun": [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(noop)],
        }
        if accelerate_available():
            accelerate = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
            commands["accelerate launch"] = [
                *accelerate,
                "--num_machines",
                "1",
                "--mixed_precision",
                "no",
                "--dynamo_backend",
                "no",
                str(noop),
            ]
        for command in commands.values():
            _time(command, env)
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in commands}
        for run in range(args.runs):
            order = list(commands) if run % 2 == 0 else list(reversed(commands))
            for name in order:
                times[name].append(_time(commands[name], env))
            print(f"run {run + 1}: " + "  ".join(f"{name} {times[name][-1][0]:.3f} s" for name in commands), flush=True)
    medians = {name: statistics.median(wall for wall, _ in values) for name, values in times.items()}
    for name, values in times.items():
        cpu = statistics.median(cpu for _, cpu in values)
        print(
            f"{name}: median {medians[name]:.3f} s, fastest {min(w for w, _ in values):.3f} s, median CPU time "
            f"{cpu:.3f} s"
        )
    if "accelerate launch" in medians:
        print(f"ratio accelerate/torchrun: {medians['accelerate launch'] / medians['torchrun']:.3f}")
    print(f"ratio hasten/torchrun: {medians['hasten launch'] / medians['torchrun']:.3f}")


if __name__ == "__main__":
    main()
