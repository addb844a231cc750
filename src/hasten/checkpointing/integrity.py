"""Checksums of checkpoint files: computed while writing, verified before anything is loaded.

Format 3 checkpoints record, for each file, the xxh3-64 of every piece of :data:`PIECE_BYTES` (the last
one shorter; ``"xxh3_64": [...]`` in the manifest, ``"piece_bytes"`` beside the files), so that the pieces
of all files are verified on every core at once, however few and large the files are. Format 2 records
one xxh3-64 per file, format 1 one zlib crc32 (``"crc32"``); both are still read. Measured on the reference
machine (2-vCPU AMD EPYC, 256 MiB buffer), xxh3-64 runs at ~25 GB/s, hardware CRC32C at ~15 GB/s and zlib's
crc32 at ~4 GB/s.

Writing hashes the bytes already in hand (the tensor's own memory, as it goes to the file) on a helper
thread, so the hash overlaps the writes. Verification hashes each piece straight from a read-only mapping
of its file (from the page cache, without a copy; from the disk with the kernel's read-ahead), on one
thread per core (the hash releases the GIL).
"""

from __future__ import annotations

import mmap
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import xxhash

from ..errors import CheckpointError

HASH_KEY = "xxh3_64"  # the manifest key of the checksum: a list of piece checksums (format 3) or one (format 2)
_LEGACY_KEY = "crc32"  # format 1
PIECE_BYTES = 32 << 20  # format 3 checksums each piece of this size (32 MiB) on its own
_INLINE_BYTES = 1 << 20  # smaller pieces are hashed inline (a thread hand-off costs more)
_BACKLOG_BYTES = 256 << 20  # bytes waiting for their hash at most
_VERIFY_PIECE = 64 << 20  # pieces of a mapped file handed to the hash (whole-file checksums)
_IO_THREADS = max(2, min(16, os.cpu_count() or 1))
_io_pool: ThreadPoolExecutor | None = None


def io_pool() -> ThreadPoolExecutor:
    """The threads that verify pieces and read them into live tensors (one per core, at least 2), kept from one
    load to the next so that a load does not start threads."""
    global _io_pool
    if _io_pool is None:
        _io_pool = ThreadPoolExecutor(max_workers=_IO_THREADS, thread_name_prefix="hasten-io")
    return _io_pool


class Digest:
    """The running checksum of one file, of the kind the manifest names: format 3's xxh3-64 of every piece of
    ``piece`` bytes, format 2's xxh3-64 of the whole file (``piece=None``), or format 1's ``crc32``."""

    def __init__(self, key: str = HASH_KEY, piece: int | None = None):
        self.key = key
        self.piece = piece if key == HASH_KEY else None
        self._xxh = xxhash.xxh3_64() if key == HASH_KEY else None
        self._crc = 0
        self._done: list[str] = []  # checksums of the finished pieces
        self._filled = 0  # bytes in the current piece
        self.queued = False  # once a piece went to the helper thread, the rest follow it (order matters)

    @classmethod
    def for_record(cls, record: dict[str, Any], piece: int | None) -> Digest:
        """The digest that checks a manifest record (pieces of ``piece`` bytes when it lists pieces)."""
        key = record_key(record)
        return cls(key, piece if isinstance(record[key], list) else None)

    def update(self, data) -> None:
        """Add ``data`` (any buffer) to the checksum."""
        if self._xxh is None:
            self._crc = zlib.crc32(data, self._crc)
        elif self.piece is None:
            self._xxh.update(data)
        else:
            view = memoryview(data).cast("B")
            while view.nbytes:
                take = min(view.nbytes, self.piece - self._filled)
                self._xxh.update(view[:take])
                self._filled += take
                view = view[take:]
                if self._filled == self.piece:
                    self._done.append(self._xxh.hexdigest())
                    self._xxh.reset()
                    self._filled = 0

    def hexdigest(self) -> str | list[str]:
        """The checksum as the manifest writes it (a list of piece checksums in format 3)."""
        if self._xxh is None:
            return f"{self._crc:08x}"
        if self.piece is None:
            return self._xxh.hexdigest()
        return self._done + ([self._xxh.hexdigest()] if self._filled or not self._done else [])


def record_key(record: dict[str, Any]) -> str:
    """Which checksum a manifest record holds (format 2's xxh3_64, or format 1's crc32)."""
    if HASH_KEY in record:
        return HASH_KEY
    if _LEGACY_KEY in record:
        return _LEGACY_KEY
    raise CheckpointError(f"A manifest record has no checksum ({record!r}): the manifest is damaged.")


class HashQueue:
    """Hashes written bytes on one helper thread, in order, while the writer goes on.

    At most ``_BACKLOG_BYTES`` wait at a time (the views keep their buffers alive), so memory stays bounded.
    """

    def __init__(self):
        self._pool: ThreadPoolExecutor | None = None
        self._backlog: list[tuple[Any, int]] = []
        self._backlog_bytes = 0

    def update(self, digest: Digest, view: memoryview) -> None:
        """Hash ``view`` into ``digest``: inline when small, else on the helper thread."""
        if view.nbytes < _INLINE_BYTES and not digest.queued:
            digest.update(view)
            return
        digest.queued = True
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hasten-hash")
        self._backlog.append((self._pool.submit(digest.update, view), view.nbytes))
        self._backlog_bytes += view.nbytes
        while self._backlog_bytes > _BACKLOG_BYTES:
            future, nbytes = self._backlog.pop(0)
            future.result()
            self._backlog_bytes -= nbytes

    def wait(self) -> None:
        """Wait until every submitted piece is hashed."""
        for future, _ in self._backlog:
            future.result()
        self._backlog.clear()
        self._backlog_bytes = 0

    def close(self) -> None:
        """Stop the helper thread."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._backlog.clear()
        self._backlog_bytes = 0


def map_file(path: Path) -> mmap.mmap | None:
    """A read-only mapping of a whole file (None for an empty file)."""
    with open(path, "rb", buffering=0) as handle:
        if os.fstat(handle.fileno()).st_size == 0:
            return None
        mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    mapped.madvise(mmap.MADV_SEQUENTIAL)
    return mapped


def mapped_digest(mapped: mmap.mmap | None, key: str = HASH_KEY, piece: int | None = None) -> str | list[str]:
    """The checksum of a mapped file, hashed straight from the mapping (no copy)."""
    digest = Digest(key, piece)
    if mapped is not None:
        with memoryview(mapped) as view:
            for start in range(0, len(view), _VERIFY_PIECE):
                with view[start : start + _VERIFY_PIECE] as chunk:
                    digest.update(chunk)
    return digest.hexdigest()


def file_digest(path: Path, key: str = HASH_KEY, piece: int | None = None) -> str | list[str]:
    """The checksum of a whole file (its pieces' checksums with ``piece``)."""
    mapped = map_file(path)
    try:
        return mapped_digest(mapped, key, piece)
    finally:
        if mapped is not None:
            mapped.close()


def corrupt_message(path: Path) -> str:
    """The one line that names a file whose checksum does not match."""
    return (
        f"{path} is corrupt: its checksum does not match the checkpoint's manifest. Restore it from a backup or "
        "use another checkpoint."
    )


def _jobs(files: dict[str, dict[str, Any]], names: list[str], piece: int | None) -> list[tuple[str, int | None]]:
    """What to check, as ``(name, piece index)``: every piece of a file that lists pieces, else the whole file
    (index None), largest first."""
    jobs = []
    for name in names:
        record = files[name]
        if isinstance(record.get(HASH_KEY), list):
            jobs += [(name, index) for index in range(len(record[HASH_KEY]))]
        else:
            jobs.append((name, None))
    whole = {name: files[name]["size"] for name in names}
    return sorted(jobs, key=lambda job: -(whole[job[0]] if job[1] is None else piece or 0))


def _pieces_cover(record: dict[str, Any], piece: int | None) -> bool:
    """False when a record lists piece checksums that cannot cover its file exactly (a damaged manifest)."""
    pieces = record.get(HASH_KEY)
    if not isinstance(pieces, list):
        return True
    return bool(piece) and len(pieces) == max(1, -(-record["size"] // piece))


def find_corrupt(
    directory: Path,
    files: dict[str, dict[str, Any]],
    names: list[str],
    piece: int | None = None,
    share: tuple[int, int] = (0, 1),
) -> list[str]:
    """The files among ``names`` whose size or checksum differs from their manifest record.

    Every piece (format 3; whole files for formats 1 and 2) is a job; ``share`` ``(i, n)`` checks jobs ``i, i+n, ...``
    only (processes sharing the work). The jobs run on one thread per core; each file is mapped once.
    """
    jobs = _jobs(files, names, piece)[share[0] :: share[1]]
    if not jobs:
        return []
    mapped: dict[str, mmap.mmap | None] = {}
    bad: set[str] = set()
    for name in {name for name, _ in jobs}:
        path = directory / name
        try:
            if path.stat().st_size != files[name]["size"] or not _pieces_cover(files[name], piece):
                bad.add(name)
            else:
                mapped[name] = map_file(path)
        except OSError:
            bad.add(name)

    def check(job: tuple[str, int | None]) -> bool:
        name, index = job
        record = files[name]
        if index is None:
            return mapped_digest(mapped[name], record_key(record), None) != record[record_key(record)]
        with memoryview(mapped[name] or b"") as view, view[index * piece : (index + 1) * piece] as chunk:
            digest = xxhash.xxh3_64(chunk).hexdigest()
        return digest != record[HASH_KEY][index]

    jobs = [job for job in jobs if job[0] not in bad]
    try:
        verdicts = list(io_pool().map(check, jobs)) if len(jobs) > 1 else [check(job) for job in jobs]
    finally:
        for handle in mapped.values():
            if handle is not None:
                handle.close()
    bad |= {name for (name, _), is_bad in zip(jobs, verdicts) if is_bad}
    return sorted(bad)
