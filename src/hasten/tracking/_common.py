"""Small helpers shared by the built-in trackers."""

from __future__ import annotations

import json
import numbers
import os
import warnings
from typing import Any

from ..errors import ConfigError
from ..runtime.fileio import atomic_write


def as_step(step: Any) -> int | None:
    """``step`` as a Python ``int`` (it may come as a tensor or a NumPy integer), or ``None``."""
    if step is None:
        return None
    if isinstance(step, numbers.Integral):
        return int(step)
    if hasattr(step, "item"):
        return int(step.item())
    raise ConfigError(f"log(step=...) must be an integer (or None), got {step!r} of type {type(step).__name__}.")


def is_number(value: Any) -> bool:
    """True for Python numbers (``bool``, ``int``, ``float``)."""
    return isinstance(value, numbers.Real)


class SkipReporter:
    """Warns once per metric name that a tracker cannot store a value, naming the tracker and the type.

    Args:
        tracker_name: the tracker's name, for the message.
        expected: what the tracker accepts, e.g. ``"a number, a string or a dict of numbers"``.
    """

    def __init__(self, tracker_name: str, expected: str):
        self.tracker_name = tracker_name
        self.expected = expected
        self._reported: set[str] = set()

    def skip(self, key: str, value: Any) -> None:
        """Report that ``key`` was not logged (only the first time for each key)."""
        if key in self._reported:
            return
        self._reported.add(key)
        warnings.warn(
            f"The {self.tracker_name!r} tracker cannot log {key!r} of type {type(value).__name__}: it expects "
            f"{self.expected}. This value was skipped (later values of {key!r} are skipped without a warning).",
            UserWarning,
            stacklevel=4,
        )


def write_json_atomically(path: str | os.PathLike, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` through a temporary file, so the file is never half-written."""
    text = json.dumps(data, indent=2, sort_keys=True) + "\n"
    atomic_write(path, lambda temporary: temporary.write_text(text, encoding="utf-8"))
