"""Size strings: how a setting gives a number of bytes (``"10GB"``, ``"1.5GiB"``, ``1024``) and how messages show one.

Settings (``ProjectConfiguration(async_staging_limit=...)``, ``max_shard_size``) and the runtime that acts on them
both read sizes here, below both.
"""

from __future__ import annotations

import re

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
