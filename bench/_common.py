"""Helpers shared by the benchmarks: summaries (median, min-max), ratio lines, free ports, contestants.

Every benchmark runs its contestants alternately (A B A B, reversing the order every other round so
that neither always runs first), keeps every sample, and reports the median with the min-max spread,
then the ratio of medians to raw PyTorch last.
"""

from __future__ import annotations

import importlib.util
import socket
import statistics
from collections.abc import Sequence


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


def free_port() -> int:
    """A TCP port nobody listens on right now (bind to port 0 and let the kernel choose)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def has_module(name: str) -> bool:
    """True when ``name`` is importable (used to add ``accelerate`` / ``lightning`` as contestants)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
