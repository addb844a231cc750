"""Helpers shared by the benchmarks: summaries (median, min-max), ratio lines, free ports, contestants.

Every benchmark runs its contestants alternately (A B A B, reversing the order every other round so
that neither always runs first), keeps every sample, and reports the median with the min-max spread,
then the ratio of medians to raw PyTorch last.
"""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def summary(samples: Sequence[float]) -> tuple[float, float, float]:
    """(median, min, max) of ``samples``."""
    return statistics.median(samples), min(samples), max(samples)


def describe(name: str, samples: Sequence[float], unit: str = "s", scale: float = 1.0, digits: int = 3) -> str:
    """One line: ``name: median X unit (min-max A-B, n=N)``."""
    median, low, high = (value * scale for value in summary(samples))
    return f"{name}: median {median:.{digits}f} {unit} (min-max {low:.{digits}f}-{high:.{digits}f}, n={len(samples)})"


def ratio_of_medians(numerator: Sequence[float], denominator: Sequence[float]) -> float:
    """median(numerator) / median(denominator)."""
    return statistics.median(numerator) / statistics.median(denominator)


def paired_ratio_range(numerator: Sequence[float], denominator: Sequence[float]) -> tuple[float, float, float]:
    """(median, min, max) of the per-round ratios of two interleaved series (a robust noise estimate)."""
    return summary([a / b for a, b in zip(numerator, denominator)])


def round_order(names: Sequence[str], round_index: int) -> list[str]:
    """The contestants' order in round ``round_index``: as given on even rounds, reversed on odd ones."""
    return list(names) if round_index % 2 == 0 else list(reversed(names))


def block_model(blocks: int):
    """The checkpoint benchmarks' model: ``blocks`` blocks of Linear 1024->4096, GELU, Linear 4096->1024 (8.4M
    parameters each), seeded."""
    import torch

    torch.manual_seed(0)
    layers = []
    for _ in range(blocks):
        layers += [torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)]
    return torch.nn.Sequential(*layers)


def free_port() -> int:
    """A TCP port nobody listens on right now (bind to port 0 and let the kernel choose)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def reference_accelerate(path: str | None = None) -> Path | None:
    """The folder holding HuggingFace's ``accelerate`` package for the workers: ``path`` when given, else the
    repository's ``.reference/accelerate-*`` when present, else None (the installed one)."""
    if path:
        return Path(path).resolve()
    found = sorted((ROOT / ".reference").glob("accelerate-*/accelerate"))
    return found[-1].parent if found else None


def worker_environment(accelerate_path: str | None = None, **variables: str) -> dict:
    """This process's environment for a worker: the reference copy of Accelerate (:func:`reference_accelerate`)
    first on ``PYTHONPATH``, then hasten's ``src``; unbuffered output; plus ``variables``."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **variables)
    reference = reference_accelerate(accelerate_path)
    paths = ([str(reference)] if reference else []) + [str(ROOT / "src")]
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def real_accelerate() -> str | None:
    """The version of HuggingFace's Accelerate that ``import accelerate`` gives this process, or None when there is
    none or it is hasten under Accelerate's name (its alias distribution)."""
    try:
        import accelerate
    except ImportError:
        return None
    if not getattr(accelerate, "Accelerator", type).__module__.startswith("accelerate."):
        return None
    return getattr(accelerate, "__version__", "?")


def accelerate_available(path: str | None = None) -> bool:
    """Whether processes started with :func:`worker_environment` (``path``) import HuggingFace's Accelerate: a
    reference copy is there, or the installed ``accelerate`` is not hasten's alias of it."""
    return reference_accelerate(path) is not None or real_accelerate() is not None


class BusyProcesses:
    """``count`` busy processes (a CPU-bound loop each, started by this process, so in its scheduling group) while
    the block runs: users' data workers keep every core busy."""

    def __init__(self, count: int):
        self.count = count
        self.processes: list[subprocess.Popen] = []

    def __enter__(self):
        self.processes = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(self.count)]
        return self

    def __exit__(self, *exc):
        for process in self.processes:
            process.kill()
            process.wait()
