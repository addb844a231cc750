"""Disk side of writing a checkpoint: early write-back, fsync, and the line a failed write gives."""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
from pathlib import Path

from ..runtime.fileio import format_bytes
from .integrity import Digest, HashQueue


def _start_writeback():
    """``sync_file_range(fd, offset, count)`` starting the disk writes of a range without waiting (Linux), or None."""
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return lambda fd, offset, count: function(fd, offset, count, _SYNC_FILE_RANGE_WRITE)


_SYNC_FILE_RANGE_WRITE = 2
_WRITEBACK_BYTES = 64 << 20  # written bytes handed to the disk at a time, while the next ones are written
_writeback = _start_writeback()


class HashingFile:
    """A binary file wrapper that counts and hashes the bytes written through it.

    Every ``_WRITEBACK_BYTES`` it asks the kernel to start writing them to the disk, so that the disk
    works while the next bytes are written and the final fsync has little left to do.
    """

    def __init__(self, handle, digest: Digest, queue: HashQueue):
        self.handle, self.digest, self.queue = handle, digest, queue
        self.size = 0
        self._flushed = 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.queue.update(self.digest, view)
        written = self.handle.write(view)
        self.size += view.nbytes
        if _writeback is not None and self.size - self._flushed >= _WRITEBACK_BYTES:
            self.handle.flush()
            _writeback(self.handle.fileno(), self._flushed, self.size - self._flushed)
            self._flushed = self.size
        return written


def fsync_path(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _free_bytes(path: Path) -> int | None:
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def failure_message(final: Path, failure: tuple[str, int | None, str], needed: int, leftover: Path | None = None) -> str:
    """One line: which path failed, why, and (for a full disk) the space needed and free.

    ``leftover``: the staging folder, when it could not be removed (the line then says so instead).
    """
    path, number, reason = failure
    removed = "the partial folder was removed" if leftover is None else f"the partial folder {leftover} could not be removed: delete it"
    if number in (errno.ENOSPC, errno.EDQUOT):
        free = _free_bytes(final.parent)
        free_text = "unknown" if free is None else format_bytes(free)
        return (
            f"Could not save the checkpoint {final}: no space left on the device (writing {path}). It needs "
            f"{format_bytes(needed)}; {free_text} is free there ({removed}). Free some space, "
            "lower ProjectConfiguration(total_limit=...), or save elsewhere; earlier checkpoints are untouched."
        )
    if number in (errno.EROFS, errno.EACCES, errno.EPERM):
        return (
            f"Could not save the checkpoint {final}: {path} is not writable ({reason}). Save to a writable folder "
            "(save_state(output_dir) or ProjectConfiguration(project_dir=...)); earlier checkpoints are untouched"
            + ("." if leftover is None else f" ({removed}).")
        )
    return f"Could not save the checkpoint {final}: {reason} (writing {path}). {removed.capitalize()}; earlier checkpoints and the folder's other files are untouched."
