"""Small helpers of ``accelerate.utils`` that scripts import: names, dicts, ports, sizes, attributes."""

from __future__ import annotations

import functools
import socket


def get_pretty_name(obj) -> str:
    """A readable name for a class, function or object (its ``__qualname__`` or ``__name__``, else ``str``)."""
    if not hasattr(obj, "__qualname__") and not hasattr(obj, "__name__"):
        obj = getattr(obj, "__class__", obj)
    return getattr(obj, "__qualname__", getattr(obj, "__name__", str(obj)))


def merge_dicts(source: dict, destination: dict) -> dict:
    """Merge ``source`` into ``destination`` recursively (nested dicts merged, other values overwritten); returns it."""
    for key, value in source.items():
        if isinstance(value, dict):
            merge_dicts(value, destination.setdefault(key, {}))
        else:
            destination[key] = value
    return destination


def is_port_in_use(port: int | None = None) -> bool:
    """True when something listens on ``port`` (default 29500) of localhost."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        return sock.connect_ex(("localhost", port or 29500)) == 0


def convert_bytes(size: float) -> str:
    """A human-readable size: ``convert_bytes(3 * 2**30)`` is ``"3.0 GB"`` (binary units)."""
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if size < 1024.0:
            return f"{round(size, 2)} {unit}"
        size /= 1024.0
    return f"{round(size, 2)} PB"


def recursive_getattr(obj, attr: str):
    """``getattr`` through a dotted path: ``recursive_getattr(model, "encoder.layer.0")``."""
    return functools.reduce(getattr, [obj] + attr.split("."))


def get_free_port() -> int:
    """A TCP port that the system reported free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]
