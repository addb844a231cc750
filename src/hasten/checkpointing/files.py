"""Writing and reading one checkpoint directory so that it appears complete or not at all.

Every process writes into ``.<name>.partial`` beside the final directory. Each file is checksummed
(crc32) while it is written and fsynced. When all processes are done, the writing process collects
every file's size and checksum into the manifest ``hasten_checkpoint.json``, written last, flushes
the folder and renames it into place (swapping atomically with an older directory of the same name
where the kernel allows). A crash at any moment leaves either the previous checkpoint or the new one.

The reader checks the manifest first (every file present, with its size), then verifies each file's
checksum while loading it, in the same pass, and names the missing or corrupt file.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import uuid
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from .. import __version__
from ..errors import CheckpointError
from ..fileio import atomic_write, fsync_directory
from ..safetensors_io import read_header, write_safetensors
from ..serialization import ALIASES_KEY, dedupe_tensors
from .state_io import decode, encode

MANIFEST = "hasten_checkpoint.json"
FORMAT_VERSION = 1
_CHUNK = 1 << 24
_THREADED_CRC_BYTES = 1 << 20  # smaller pieces are checksummed inline (a thread hand-off costs more)
_BACKLOG_BYTES = 256 << 20  # bytes waiting for their checksum at most


class _CrcQueue:
    """Checksums written bytes on one helper thread, in order, while the writer goes on.

    ``zlib.crc32`` releases the GIL, so the checksums overlap the writes of later files and the final
    fsyncs instead of adding to them. At most ``_BACKLOG_BYTES`` wait at a time (the views keep their
    buffers alive, e.g. CPU copies of GPU tensors), so memory stays bounded.
    """

    def __init__(self):
        self._pool: ThreadPoolExecutor | None = None
        self._backlog: list[tuple[Any, int]] = []
        self._backlog_bytes = 0

    def submit(self, crc: _Crc, view: memoryview) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hasten-crc32")
        self._backlog.append((self._pool.submit(crc._update, view), view.nbytes))
        self._backlog_bytes += view.nbytes
        while self._backlog_bytes > _BACKLOG_BYTES:
            future, nbytes = self._backlog.pop(0)
            future.result()
            self._backlog_bytes -= nbytes

    def wait(self) -> None:
        """Wait until every submitted piece is checksummed."""
        for future, _ in self._backlog:
            future.result()
        self._backlog.clear()
        self._backlog_bytes = 0

    def close(self) -> None:
        """Stop the helper thread."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


class _Crc:
    """The running crc32 of one file; large pieces go to the writer's :class:`_CrcQueue`."""

    def __init__(self, queue: _CrcQueue):
        self.value = 0
        self.queue = queue
        self.queued = False

    def update(self, view: memoryview) -> None:
        if not self.queued and view.nbytes < _THREADED_CRC_BYTES:
            self.value = zlib.crc32(view, self.value)  # small pieces inline: a hand-off costs more
            return
        self.queued = True
        self.queue.submit(self, view)

    def _update(self, view: memoryview) -> None:
        self.value = zlib.crc32(view, self.value)


class _ChecksumFile:
    """A binary file wrapper that counts and checksums the bytes written through it."""

    def __init__(self, handle, crc: _Crc):
        self.handle = handle
        self.crc = crc
        self.size = 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.crc.update(view)
        self.size += view.nbytes
        return self.handle.write(view)


def _fsync_path(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _file_record(path: Path) -> dict[str, Any]:
    crc = 0
    with open(path, "rb", buffering=0) as handle:
        while chunk := handle.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return {"size": path.stat().st_size, "crc32": f"{crc:08x}"}


class CheckpointWriter:
    """Writes the files of one checkpoint into a temporary folder, then publishes it atomically.

    Args:
        final_dir: where the checkpoint will appear.
        is_main: this process writes shared files and publishes the folder (the main process, or each
            machine's local main process with ``save_on_each_node``).
        rank: this process's global rank.
        group: the key of the processes whose files end up in the same folder (the machine's index with
            ``save_on_each_node``, 0 otherwise).
        solo: the writing process writes every file and no other process takes part (no collective;
            see :mod:`hasten.checkpointing.participants`).
    """

    def __init__(self, final_dir: str | os.PathLike, *, is_main: bool, rank: int, group: int = 0, solo: bool = False):
        self.solo = solo
        self.final = Path(final_dir).absolute()
        self.directory = self.final.parent / f".{self.final.name}.partial"
        self.is_main = is_main
        self.rank = rank
        self.group = group
        self._records: dict[str, dict[str, Any]] = {}
        self._tracked: list[str] = []
        self._unsynced: list[Path] = []
        self._crcs: dict[str, _Crc] = {}
        self._crc_queue = _CrcQueue()

    def begin(self) -> None:
        """Create the temporary folder (the writing process first clears a leftover from a crash)."""
        from ..operations import barrier

        if self.is_main:
            if self.directory.exists():
                shutil.rmtree(self.directory)
            self.directory.mkdir(parents=True)
        if not self.solo:
            barrier()
        self.directory.mkdir(parents=True, exist_ok=True)

    def _write(self, name: str, fill) -> None:
        path = self.directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        crc = _Crc(self._crc_queue)
        try:
            with open(path, "wb") as raw:
                out = _ChecksumFile(raw, crc)
                fill(out)
        except BaseException:
            self._crc_queue.close()
            raise
        self._records[name] = {"size": out.size}
        self._crcs[name] = crc  # resolved by finalize(), while the files are flushed
        self._unsynced.append(path)  # flushed to disk, all together, by finalize()

    def save_tensors(self, name: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
        """Write ``tensors`` as a safetensors file; tensors sharing memory (tied weights) are stored once."""
        unique, aliases = dedupe_tensors(tensors)
        header = dict(metadata or {})
        if aliases:
            header[ALIASES_KEY] = json.dumps(aliases)
        self._write(name, lambda out: write_safetensors(out, unique, header or None))

    def save_json(self, name: str, obj: Any) -> None:
        """Write ``obj`` as JSON."""
        data = json.dumps(obj, indent=1).encode("utf-8")
        self._write(name, lambda out: out.write(data))

    def save_state(self, name: str, obj: Any) -> None:
        """Write a nested state dict as ``<name>.json`` (structure) and ``<name>.safetensors`` (tensors)."""
        tree, tensors = encode(obj, name)
        if tensors:
            self.save_tensors(f"{name}.safetensors", tensors)
        self.save_json(f"{name}.json", {"tree": tree, "has_tensors": bool(tensors)})

    def track(self, relative_path: str | os.PathLike) -> None:
        """Register a file or folder written into :attr:`directory` by someone else (an engine)."""
        self._tracked.append(str(relative_path))

    def _tracked_records(self) -> dict[str, dict[str, Any]]:
        records = {}
        for rel in self._tracked:
            root = self.directory / rel
            paths = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
            for path in paths:
                records[path.relative_to(self.directory).as_posix()] = _file_record(path)
                self._unsynced.append(path)
        return records

    def _sync_files(self) -> None:
        """fsync every file this process wrote, concurrently: the disk sees all the data at once and
        the filesystem can merge the journal commits (one fsync per file, in turn, is markedly slower)."""
        paths, self._unsynced = self._unsynced, []
        if not paths:
            return
        with ThreadPoolExecutor(max_workers=min(8, len(paths)), thread_name_prefix="hasten-fsync") as pool:
            list(pool.map(_fsync_path, paths))

    def finalize(self, info: dict[str, Any]) -> Path:
        """Collect every process's files, write the manifest last and publish the folder. Returns its path."""
        from ..operations import barrier, gather_object

        records = {**self._records, **self._tracked_records()}
        self._sync_files()
        self._crc_queue.wait()
        self._crc_queue.close()
        for name, crc in self._crcs.items():
            records[name]["crc32"] = f"{crc.value:08x}"
        everyone = [(self.group, self.rank, records)] if self.solo else gather_object([(self.group, self.rank, records)])
        if self.is_main:
            files: dict[str, dict[str, Any]] = {}
            for group, _, recs in everyone:
                if group == self.group:
                    files.update(recs)
            self._check_visible(files, everyone)
            manifest = {"format": "hasten-checkpoint", "format_version": FORMAT_VERSION, "hasten_version": __version__, "torch_version": torch.__version__, **info, "files": dict(sorted(files.items()))}
            for folder in {self.directory / Path(name).parent for name in files}:
                fsync_directory(folder)
            atomic_write(self.directory / MANIFEST, lambda tmp: tmp.write_text(json.dumps(manifest, indent=1)))
            _publish(self.directory, self.final)
        if not self.solo:
            barrier()
        return self.final

    def _check_visible(self, files: dict, everyone: list) -> None:
        missing = [name for name in files if not (self.directory / name).is_file()]
        if missing:
            writers = sorted({rank for _, rank, recs in everyone if set(recs) & set(missing)})
            raise CheckpointError(
                f"Files written by rank(s) {writers} are not visible from this process (e.g. {missing[0]!r} in "
                f"{self.directory}): the machines do not share this filesystem. Use a shared folder, or "
                "ProjectConfiguration(save_on_each_node=True) to keep a checkpoint on every machine."
            )


def _rename_exchange(source: Path, target: Path) -> bool:
    """Atomically swap two paths with renameat2(RENAME_EXCHANGE); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    result = renameat2(at_fdcwd, os.fsencode(source), at_fdcwd, os.fsencode(target), rename_exchange)
    return result == 0


def _publish(temporary: Path, final: Path) -> None:
    """Move the completed ``temporary`` folder to ``final``, replacing an older one without a gap where possible."""
    if not final.exists():
        os.rename(temporary, final)
    elif _rename_exchange(temporary, final):
        shutil.rmtree(temporary)  # now holds the old checkpoint
    else:
        old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(final, old)
        os.rename(temporary, final)
        shutil.rmtree(old)
    fsync_directory(final.parent)


def read_manifest(directory: str | os.PathLike) -> dict[str, Any]:
    """The manifest of a checkpoint folder; :class:`CheckpointError` if it is missing or unreadable."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not directory.is_dir():
        raise CheckpointError(f"Checkpoint folder {directory} does not exist.")
    if not path.is_file():
        raise CheckpointError(
            f"{directory} is not a complete hasten checkpoint: {MANIFEST} is missing. Its save was interrupted, "
            "or it was written by another tool (see docs/checkpointing.md to migrate an Accelerate checkpoint)."
        )
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{path} is unreadable or corrupt: {error}") from error
    if manifest.get("format") != "hasten-checkpoint" or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{path} is not a hasten checkpoint manifest.")
    if manifest.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(f"{directory} was written by a newer hasten (format {manifest['format_version']}); upgrade hasten to load it.")
    return manifest


class CheckpointReader:
    """Reads the files of a complete checkpoint, verifying each against the manifest."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self.manifest = read_manifest(self.directory)
        self.files: dict[str, dict[str, Any]] = self.manifest["files"]
        for name, record in self.files.items():
            path = self.directory / name
            if not path.is_file():
                raise CheckpointError(f"Checkpoint {self.directory} is missing {name!r}, which its manifest lists.")
            if path.stat().st_size != record["size"]:
                raise CheckpointError(
                    f"{path} is truncated or corrupt: {path.stat().st_size} bytes where the manifest says {record['size']}."
                )

    def exists(self, name: str) -> bool:
        """True when the checkpoint holds file ``name``."""
        return name in self.files

    def _record(self, name: str) -> dict[str, Any]:
        if name not in self.files:
            raise CheckpointError(f"Checkpoint {self.directory} has no {name!r} (it holds: {', '.join(sorted(self.files)[:12])}...).")
        return self.files[name]

    def load_tensors(self, name: str) -> dict[str, torch.Tensor]:
        """Read a safetensors file of the checkpoint into CPU tensors, verifying its checksum in the same pass."""
        record = self._record(name)
        path = self.directory / name
        header = read_header(path)
        tensors, position = {}, 0
        queue = _CrcQueue()
        crc = _Crc(queue)
        with open(path, "rb", buffering=0) as handle, contextlib.closing(queue):
            for entry_name, entry in header.entries.items():
                position = _crc_bytes(handle, crc, position, entry.begin - position)
                out = torch.empty(entry.shape, dtype=entry.dtype)
                if entry.nbytes:
                    view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
                    _read_into(handle, view, path)
                    crc.update(view)
                    position += entry.nbytes
                tensors[entry_name] = out
            _crc_bytes(handle, crc, position, None)
            queue.wait()
        if f"{crc.value:08x}" != record["crc32"]:
            raise CheckpointError(f"{path} is corrupt: its checksum does not match the manifest. Restore it from a backup or use another checkpoint.")
        aliases = json.loads(header.metadata.get(ALIASES_KEY, "{}"))
        for alias, source in aliases.items():
            tensors[alias] = tensors[source]
        return tensors

    def load_json(self, name: str) -> Any:
        """Read a JSON file of the checkpoint, verifying its checksum."""
        record = self._record(name)
        data = (self.directory / name).read_bytes()
        if f"{zlib.crc32(data):08x}" != record["crc32"]:
            raise CheckpointError(f"{self.directory / name} is corrupt: its checksum does not match the manifest.")
        return json.loads(data)

    def load_state(self, name: str) -> Any:
        """Read a nested state written by :meth:`CheckpointWriter.save_state`."""
        meta = self.load_json(f"{name}.json")
        tensors = self.load_tensors(f"{name}.safetensors") if meta.get("has_tensors") else {}
        return decode(meta["tree"], tensors)


def _read_into(handle, view: memoryview, path: Path) -> None:
    done = 0
    while done < len(view):
        count = handle.readinto(view[done : done + (1 << 30)])
        if not count:
            raise CheckpointError(f"{path} is truncated: it ended while reading tensor data.")
        done += count


def _crc_bytes(handle, crc: _Crc, position: int, count: int | None) -> int:
    """Checksum ``count`` bytes from ``position`` (all remaining bytes when None); returns the new position."""
    handle.seek(position)
    remaining = count
    while remaining is None or remaining > 0:
        chunk = handle.read(_CHUNK if remaining is None else min(_CHUNK, remaining))
        if not chunk:
            break
        crc.update(memoryview(chunk))
        position += len(chunk)
        if remaining is not None:
            remaining -= len(chunk)
    return position
