"""Disk side of writing a checkpoint: early write-back, direct writes, fsync, and the line a failed write gives."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import shutil
from pathlib import Path

import numpy as np

from ..settings.sizes import format_bytes
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
    works while the next bytes are written and the final fsync has little left to do (a :class:`DirectFile`
    writes to the disk as it goes).
    """

    def __init__(self, handle, digest: Digest, queue: HashQueue):
        self.handle, self.digest, self.queue = handle, digest, queue
        self.size = 0
        self._flushed = 0
        self._writeback = None if isinstance(handle, DirectFile) else _writeback

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.queue.update(self.digest, view)
        written = self.handle.write(view)
        self.size += view.nbytes
        if self._writeback is not None and self.size - self._flushed >= _WRITEBACK_BYTES:
            self.handle.flush()
            self._writeback(self.handle.fileno(), self._flushed, self.size - self._flushed)
            self._flushed = self.size
        return written


_DIRECT_ALIGN = 4096  # O_DIRECT needs the buffer, the offset and the length aligned to the device's block
_BOUNCE_BYTES = 16 << 20


class DirectFile:
    """A file written with ``O_DIRECT`` through an aligned bounce buffer: the bytes go from the buffer to the
    disk by DMA, without the page cache (whose copies, allocations and write-back cost a core as much as the
    disk's time on a busy machine). The last partial block is padded, then the file is truncated to its size.

    :meth:`open` returns None where the filesystem refuses ``O_DIRECT`` (tmpfs, some network filesystems):
    the caller then writes through the page cache.
    """

    def __init__(self, fd: int, bounce):
        self._fd, self._bounce = fd, bounce
        self._array = np.frombuffer(bounce, dtype=np.uint8)
        self._filled = 0
        self.size = 0

    @classmethod
    def open(cls, path: Path, bounce) -> DirectFile | None:
        """``path`` opened for direct writing (created or truncated), or None where ``O_DIRECT`` is refused."""
        flag = getattr(os, "O_DIRECT", None)
        if flag is None:
            return None
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flag, 0o644)
        except OSError as error:
            if error.errno == errno.EINVAL:
                return None
            raise
        return cls(fd, bounce)

    def write(self, data) -> int:
        view = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
        done = 0
        while done < view.size:
            take = min(view.size - done, self._array.size - self._filled)
            self._array[self._filled : self._filled + take] = view[done : done + take]  # a memcpy, without the GIL
            self._filled += take
            done += take
            if self._filled == self._array.size:
                self._drain(self._filled)
        self.size += view.size
        return view.size

    def _drain(self, count: int) -> None:
        written, view = 0, memoryview(self._bounce)[:count]
        while written < count:
            written += os.write(self._fd, view[written:])
        self._filled = 0

    def close(self) -> None:
        """Write what is left (padded to a block, then truncated to the file's size) and close the file."""
        try:
            if self._filled:
                padded = -(-self._filled // _DIRECT_ALIGN) * _DIRECT_ALIGN
                self._array[self._filled : padded] = 0
                self._drain(padded)
                os.ftruncate(self._fd, self.size)
        finally:
            os.close(self._fd)

    def __enter__(self) -> DirectFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def bounce_buffer() -> mmap.mmap:
    """A page-aligned buffer for :class:`DirectFile` (anonymous memory, freed with its last reference)."""
    return mmap.mmap(-1, _BOUNCE_BYTES)


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


def failure_message(
    final: Path, failure: tuple[str, int | None, str], needed: int, leftover: Path | None = None
) -> str:
    """One line: which path failed, why, and (for a full disk) the space needed and free.

    ``leftover``: the staging folder, when it could not be removed (the line then says so instead).
    """
    path, number, reason = failure
    removed = (
        "the partial folder was removed"
        if leftover is None
        else f"the partial folder {leftover} could not be removed: delete it"
    )
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
    return (
        f"Could not save the checkpoint {final}: {reason} (writing {path}). {removed.capitalize()}; earlier "
        "checkpoints and the folder's other files are untouched."
    )
