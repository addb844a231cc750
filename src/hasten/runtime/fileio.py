"""Small file helpers shared by the savers: atomic writes, flushing a folder entry."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path


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
