"""Small file helpers shared by the savers: atomic writes and size strings."""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Callable
from pathlib import Path

from ..errors import ConfigError

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")


def parse_size(size: int | str) -> int:
    """Turn a size such as ``"10GB"``, ``"500MB"``, ``"1.5GiB"`` or ``1024`` into a number of bytes.

    ``KB``/``MB``/``GB``/``TB`` are powers of 1000, ``KiB``/``MiB``/``GiB``/``TiB`` powers of 1024 (case
    does not matter), and a lowercase ``b`` after the prefix (``"5Gb"``) means bits, as in Accelerate.

    Raises:
        ConfigError: the value is negative or not a size.
    """
    if isinstance(size, bool):
        raise ConfigError(f"Invalid size {size!r}: expected a number of bytes or a string like '10GB' or '1.5GiB'.")
    if isinstance(size, (int, float)):
        if size < 0 or size != size:
            raise ConfigError(f"Invalid size {size!r}: a size must be a non-negative number of bytes.")
        return int(size)
    match = _SIZE.match(str(size))
    unit = match.group(2) if match else None
    if match is None or unit.upper() not in _UNITS:
        raise ConfigError(
            f"Invalid size {size!r}: expected a number of bytes or a number followed by a unit "
            "(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. '10GB' or '1.5GiB'."
        )
    value = float(match.group(1)) * _UNITS[unit.upper()]
    is_bits = len(unit) >= 2 and unit.endswith("b") and unit.upper() in {"KB", "MB", "GB", "TB"}
    return int(value / 8) if is_bits else int(value)


def format_bytes(count: float | None) -> str:
    """``1.61 GB``-style text (binary units); ``N/A`` for None."""
    if count is None:
        return "N/A"
    if count < 1024:
        return f"{int(count)} bytes"
    for unit in ("KB", "MB", "GB"):
        count /= 1024
        if count < 1024:
            return f"{count:.2f} {unit}"
    return f"{count / 1024:.2f} TB"


def fsync_directory(path: str | os.PathLike) -> None:
    """Flush a directory entry (a rename into it) to disk; a no-op where directories cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike, writer: Callable[[Path], None]) -> Path:
    """Write ``path`` so that it holds either its old contents or the complete new ones, never a part.

    ``writer`` is called with a temporary path in the same folder and must create that file. The
    file is then flushed to disk, renamed over ``path`` and the folder entry flushed too. If
    ``writer`` raises, the temporary file is removed and ``path`` is untouched.

    Args:
        path: the file to write (its folder is created if needed).
        writer: ``writer(temporary_path)`` writes the contents.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        writer(temporary)
        with open(temporary, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)
    return path
