"""Writing and reading one checkpoint directory so that it appears complete or not at all.

Every process writes into a staging folder (``.<name>.partial`` beside the target; see ``publishing.py``).
Each file is checksummed (xxh3-64, see ``integrity.py``) while it is written and fsynced. When all processes
are done, the writing process collects every file's size and checksum into the manifest
``hasten_checkpoint.json``, written last, and publishes the folder at the target: a rename or an atomic
swap for a new folder or one that holds only an older checkpoint, a file-by-file move (the manifest last)
into a folder that also holds the user's files, which stay. A crash at any moment leaves either the
previous checkpoint or the new one.

The reader checks the manifest first (every file present, with its size); ``load_state`` then verifies
every file's checksum before it changes any live object, and names the missing or corrupt file.
"""

from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError
from ..runtime.fileio import atomic_write, fsync_directory
from ..runtime.weights.files import ALIASES_KEY
from ..runtime.weights.safetensors_io import dedupe_tensors, read_header, safetensors_size, write_safetensors
from . import integrity
from .disk import DirectFile, HashingFile, bounce_buffer, failure_message, fsync_path
from .integrity import HASH_KEY, Digest, HashQueue, corrupt_message, file_digest, find_corrupt
from .manifest import FORMAT_VERSION, build_manifest, check_listed_files, read_manifest  # noqa: F401 (re-exported)
from .parts import read_parts
from .publishing import MANIFEST, publish, remove_staging, resolve_target, staging_folder
from .staging import Stager
from .state_io import decode, encode


def _file_record(path: Path) -> dict[str, Any]:
    return {"size": path.stat().st_size, HASH_KEY: file_digest(path, HASH_KEY, integrity.PIECE_BYTES)}


class CheckpointWriter:
    """Writes the files of one checkpoint into a temporary folder, then publishes it atomically.

    A write that fails (full disk, read-only folder...) does not raise at once: the writer notes the
    error, goes on counting the bytes the checkpoint needs, and :meth:`finalize` removes the partial
    folder and raises one :class:`CheckpointError` on every process (so no process is left waiting in
    a collective for one that failed).

    Args:
        final_dir: where the checkpoint will appear.
        is_main: this process writes shared files and publishes the folder (the main process, or each
            machine's local main process with ``save_on_each_node``).
        rank: this process's global rank.
        group: the key of the processes whose files end up in the same folder (the machine's index with
            ``save_on_each_node``, 0 otherwise).
        snapshot: keep the tensors handed over and write them later, for asynchronous saves: small CPU
            tensors are copied at once; the CPU tensors whose ``data_ptr()`` is in ``live`` and the tensors on
            a GPU are staged (:meth:`stage`, see ``staging.py``).
        live: the memory of tensors that the caller keeps unchanged until :meth:`copy_staged` and
            :meth:`write_live` return (the next optimizer step waits for them).
        solo: the writing process writes every file and no other process takes part (no collective;
            see :mod:`hasten.checkpointing.participants`).
    """

    def __init__(
        self,
        final_dir: str | os.PathLike,
        *,
        is_main: bool,
        rank: int,
        group: int = 0,
        snapshot: bool = False,
        live: frozenset[int] = frozenset(),
        solo: bool = False,
    ):
        self.solo = solo
        self.final = resolve_target(final_dir)
        self.directory = staging_folder(self.final)
        self.is_main = is_main
        self.rank = rank
        self.group = group
        self.snapshot = snapshot
        self._live = live
        self._records: dict[str, dict[str, Any]] = {}
        self._tracked: list[str] = []
        self._unsynced: list[Path] = []
        self._digests: dict[str, Digest] = {}
        self._queue = HashQueue()
        self._pending: list[tuple[str, int, Any]] = []
        self._failure: tuple[str, int | None, str] | None = None  # (path, errno, message)
        self._bytes = 0  # bytes this process's files need (written or not)
        self._stager = Stager()
        self._bounce = None  # the aligned buffer of direct writes (asynchronous saves)

    def _fail(self, error: OSError, path: Path) -> None:
        if self._failure is None:
            self._failure = (str(error.filename or path), error.errno, error.strerror or str(error))

    def begin(self) -> None:
        """Create the temporary folder (the writing process first clears a leftover from a crash)."""
        from ..runtime.operations import barrier

        if self.is_main:
            try:
                if self.directory.exists():
                    shutil.rmtree(self.directory)
                self.directory.mkdir(parents=True)
            except OSError as error:
                self._fail(error, self.directory)
        if not self.solo:
            barrier()
        if self._failure is None:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
            except OSError as error:
                self._fail(error, self.directory)

    def _write(self, name: str, nbytes: int, fill) -> None:
        self._bytes += nbytes
        if self.snapshot:
            self._pending.append((name, nbytes, fill))
        elif self._failure is None:
            self._write_now(name, fill)

    def _write_now(self, name: str, fill, direct: bool = False) -> None:
        path = self.directory / name
        digest = Digest(HASH_KEY, integrity.PIECE_BYTES)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if direct and self._bounce is None:
                self._bounce = bounce_buffer()
            with (direct and DirectFile.open(path, self._bounce)) or open(path, "wb") as raw:
                out = HashingFile(raw, digest, self._queue)
                fill(out)
        except OSError as error:
            self._fail(error, path)
            return
        self._records[name] = {"size": out.size}
        self._digests[name] = digest  # resolved by finalize(), while the files are flushed
        self._unsynced.append(path)  # flushed to disk, all together, by finalize()

    def stage(self, limit: int | None) -> int:
        """Snapshot mode: reserve the staging memory and queue the device-to-host copies (in ``save_state``);
        ``limit`` bounds the staged bytes (whole files, in write order). Returns the bytes staged."""
        self._stager.stage(limit)
        return self._stager.staged_bytes

    def copy_staged(self) -> None:
        """Snapshot mode, background: copy the staged CPU tensors (training's next optimizer step waits for it)."""
        self._stager.copy()

    def write_live(self) -> None:
        """Snapshot mode, background: write the files that still read live memory (not staged under a limit);
        returns once their bytes are hashed too (the live tensors may change after)."""
        self._write_pending([entry for entry in self._pending if not self._stager.is_staged(entry[0])])
        self._queue.wait()

    def write_pending(self) -> None:
        """Snapshot mode, background: write every file handed over and not written yet, from the staging buffer
        to the disk directly (``O_DIRECT``) where the filesystem allows."""
        self._stager.wait_for_device()
        self._write_pending(list(self._pending), direct=True)

    def _write_pending(self, entries: list, direct: bool = False) -> None:
        for entry in entries:
            self._pending.remove(entry)
            if self._failure is None:
                self._write_now(entry[0], entry[2], direct)

    def save_tensors(self, name: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
        """Write ``tensors`` as a safetensors file; tensors sharing memory (tied weights) are stored once."""
        unique, aliases = dedupe_tensors(tensors)
        header = dict(metadata or {})
        if aliases:
            header[ALIASES_KEY] = json.dumps(aliases)
        if self.snapshot:
            unique = {key: self._keep(value) for key, value in unique.items()}
            live = [value for value in unique.values() if value.data_ptr() in self._live]
            volatile = [
                value for value in unique.values() if value.device.type != "cpu" and value.data_ptr() not in self._live
            ]
            self._stager.add(name, live, volatile)
            size = safetensors_size(unique, header or None)
            self._write(name, size, lambda out: write_safetensors(out, self._stager.resolve(unique), header or None))
            return
        self._write(
            name, safetensors_size(unique, header or None), lambda out: write_safetensors(out, unique, header or None)
        )

    def _needs_staging(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type != "cpu" or tensor.data_ptr() in self._live

    def _keep(self, tensor: torch.Tensor) -> torch.Tensor:
        """What an asynchronous save keeps of ``tensor`` until it is staged or written: live and GPU tensors as
        they are (staged later), any other tensor copied now (it may change at any time)."""
        tensor = tensor.detach()
        return tensor if self._needs_staging(tensor) else tensor.clone(memory_format=torch.contiguous_format)

    def save_json(self, name: str, obj: Any) -> None:
        """Write ``obj`` as JSON."""
        data = json.dumps(obj, indent=1).encode("utf-8")
        self._write(name, len(data), lambda out: out.write(data))

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
                self._bytes += records[path.relative_to(self.directory).as_posix()]["size"]
                self._unsynced.append(path)
        return records

    def _sync_files(self) -> None:
        """fsync every file this process wrote, concurrently: the disk sees all the data at once and
        the filesystem can merge the journal commits (one fsync per file, in turn, is markedly slower)."""
        paths, self._unsynced = self._unsynced, []
        if not paths:
            return
        with ThreadPoolExecutor(max_workers=min(8, len(paths)), thread_name_prefix="hasten-fsync") as pool:
            list(pool.map(fsync_path, paths))

    def _local_records(self) -> dict[str, dict[str, Any]]:
        """This process's files, flushed to disk, with their sizes and checksums (empty after a failure)."""
        try:
            if self._failure is None:
                records = {**self._records, **self._tracked_records()}
                self._sync_files()
                self._queue.wait()
                for name, digest in self._digests.items():
                    records[name][HASH_KEY] = digest.hexdigest()
                return records
        except OSError as error:
            self._fail(error, self.directory)
        finally:
            self._queue.close()
        return {}

    def _gather(self, obj: Any, group) -> list:
        return [obj] if self.solo else _gather(obj, group)

    def finalize(self, info: dict[str, Any], group=None) -> Path:
        """Collect every process's files, write the manifest last and publish the folder. Returns its path.

        ``group`` is the process group of the collectives (an asynchronous save uses its own, so that its
        background thread never shares one with the training loop). Every process raises the same
        :class:`CheckpointError` when any of them failed to write, after the partial folder is removed.
        """
        records = self._local_records()
        everyone = self._gather((self.group, self.rank, records, self._failure, self._bytes), group)
        failures = [(rank, failure) for _, rank, _, failure, _ in everyone if failure is not None]
        outcome = None
        if self.is_main and not failures:
            try:
                self._publish(info, everyone)
            except OSError as error:
                self._fail(error, self.directory)
                failures = [(self.rank, self._failure)]
            except CheckpointError as error:
                outcome = str(error)
        if self.is_main and failures:
            leftover = None if remove_staging(self.directory) else self.directory
            outcome = failure_message(
                self.final, failures[0][1], sum(entry[4] for entry in everyone if entry[0] == self.group), leftover
            )
        outcomes = [found for found in self._gather(outcome, group) if found is not None]
        if outcomes:
            raise CheckpointError(outcomes[0])
        return self.final

    def _publish(self, info: dict[str, Any], everyone: list) -> None:
        files: dict[str, dict[str, Any]] = {}
        for group, _, recs, _, _ in everyone:
            if group == self.group:
                files.update(recs)
        self._check_visible(files, everyone)
        manifest = build_manifest(info, files)
        for folder in {self.directory / Path(name).parent for name in files}:
            fsync_directory(folder)
        atomic_write(self.directory / MANIFEST, lambda tmp: tmp.write_text(json.dumps(manifest, indent=1)))
        publish(self.directory, self.final)

    def discard(self) -> None:
        """Remove the temporary folder (after an error outside the writer); the previous checkpoints stay."""
        self._queue.close()
        if self.is_main:
            shutil.rmtree(self.directory, ignore_errors=True)

    def _check_visible(self, files: dict, everyone: list) -> None:
        missing = [name for name in files if not (self.directory / name).is_file()]
        if missing:
            writers = sorted({entry[1] for entry in everyone if set(entry[2]) & set(missing)})
            raise CheckpointError(
                f"Files written by rank(s) {writers} are not visible from this process (e.g. {missing[0]!r} in "
                f"{self.directory}): the machines do not share this filesystem. Use a shared folder, or "
                "ProjectConfiguration(save_on_each_node=True) to keep a checkpoint on every machine."
            )


def _gather(obj: Any, group) -> list:
    """Every process's ``obj``, in rank order (over ``group`` when given)."""
    if group is None:
        from ..runtime.operations import gather_object

        return gather_object([obj])
    import torch.distributed as dist

    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


class CheckpointReader:
    """Reads the files of a complete checkpoint, verifying each against the manifest.

    :meth:`verify` checks files against their checksums before anything is loaded (``load_state``
    verifies every file before it changes any live object); a file read without that is checksummed
    while it is read, in the same pass, and refused if it does not match. :attr:`files` holds the manifest's
    files and the random states processes added after the publish (:attr:`parts`, see ``parts.py``).
    """

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self.manifest = read_manifest(self.directory)
        self.parts = read_parts(self.directory, self.manifest.get("save_id"))  # random states added after publish
        self.files: dict[str, dict[str, Any]] = {**self.parts, **self.manifest["files"]}
        self.piece: int | None = self.manifest.get(
            "piece_bytes"
        )  # format 3: each file's checksums cover pieces of this size
        self._verified: set[str] = set()
        self._headers: dict[str, Any] = {}
        check_listed_files(self.directory, self.files)

    def _header(self, name: str):
        """The checked header of safetensors file ``name`` (read once per reader)."""
        if name not in self._headers:
            self._headers[name] = read_header(self.directory / name)
        return self._headers[name]

    def exists(self, name: str) -> bool:
        """True when the checkpoint holds file ``name``."""
        return name in self.files

    def _record(self, name: str) -> dict[str, Any]:
        if name not in self.files:
            raise CheckpointError(
                f"Checkpoint {self.directory} has no {name!r} (it holds: {', '.join(sorted(self.files)[:12])}...)."
            )
        return self.files[name]

    def tensor_shapes(self, name: str) -> dict[str, tuple[int, ...] | None]:
        """The shape of every tensor (tied aliases included) in safetensors file ``name``, read from its header."""
        header = self._header(name)
        shapes = {key: tuple(entry.shape) for key, entry in header.entries.items()}
        for alias, source in json.loads(header.metadata.get(ALIASES_KEY, "{}")).items():
            shapes[alias] = shapes.get(source)
        return shapes

    def param_group_keys(self, name: str) -> list[list] | None:
        """What each group of saved optimizer ``name`` lists under ``params`` (positions, or FSDP2's parameter names),
        read without its tensors; None when it holds no groups."""
        tree = self.load_json(f"{name}.json")["tree"]
        groups = tree.get("param_groups") if isinstance(tree, dict) else None
        return [list(group.get("params", [])) for group in groups] if isinstance(groups, list) else None

    def param_group_sizes(self, name: str) -> list[int] | None:
        """The number of parameters in each group of saved optimizer ``name`` (None when it holds no groups)."""
        keys = self.param_group_keys(name)
        return None if keys is None else [len(group) for group in keys]

    def find_corrupt(self, names: list[str] | None = None, share: tuple[int, int] = (0, 1)) -> list[str]:
        """The files among ``names`` (all by default) whose checksum does not match; the others count as verified.

        ``share`` ``(i, n)``: check only every n-th piece from the i-th (processes sharing the work; nothing is
        then marked verified, see :meth:`mark_verified`).
        """
        names = sorted(self.files) if names is None else [name for name in names if name not in self._verified]
        bad = find_corrupt(self.directory, self.files, names, self.piece, share)
        if share == (0, 1):
            self.mark_verified(set(names) - set(bad))
        return bad

    def mark_verified(self, names) -> None:
        """Record that ``names`` were checked (by this process or another one sharing the folder)."""
        self._verified.update(names)

    def verify(self, names: list[str] | None = None) -> None:
        """Check ``names`` (all files by default) against their checksums; :class:`CheckpointError` names the first bad
        one."""
        bad = self.find_corrupt(names)
        if bad:
            raise CheckpointError(corrupt_message(self.directory / bad[0]))

    def check_bytes(self, name: str, data) -> None:
        """Check the whole contents ``data`` of file ``name`` (read by an engine) against the manifest."""
        record = self._record(name)
        if name in self._verified:
            return
        digest = Digest.for_record(record, self.piece)
        digest.update(data)
        if digest.hexdigest() != record[digest.key]:
            raise CheckpointError(corrupt_message(self.directory / name))
        self._verified.add(name)

    def load_tensors(self, name: str, into: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Read a safetensors file of the checkpoint into CPU tensors.

        Args:
            name: the file, relative to the checkpoint folder.
            into: tensors to fill in place where name, shape and dtype match and the tensor is a contiguous
                CPU tensor (one copy, from the page cache or the disk, straight into live memory); the file
                is verified first, so they are only changed when it is whole.

        Returns:
            name -> tensor (the tensor of ``into`` where it was filled, a new tensor otherwise).
        """
        record = self._record(name)
        if into and name not in self._verified:
            self.verify([name])
        path = self.directory / name
        header = self._header(name)
        digest = None if name in self._verified else Digest.for_record(record, self.piece)
        queue = HashQueue()
        tensors, position, reads = {}, 0, []
        try:
            with open(path, "rb", buffering=0) as handle:
                for entry_name, entry in header.entries.items():
                    position = _hash_range(handle, digest, position, entry.begin - position)
                    target = (into or {}).get(entry_name)
                    out = target if _fits(target, entry) else torch.empty(entry.shape, dtype=entry.dtype)
                    if entry.nbytes and digest is None:
                        reads.append((entry.begin, out))
                    elif entry.nbytes:
                        view = memoryview(out.detach().reshape(-1).view(torch.uint8).numpy())
                        read_into(handle, view, path)
                        queue.update(digest, view)
                        position += entry.nbytes
                    tensors[entry_name] = out
                _hash_range(handle, digest, position, None)
                _pread_all(handle.fileno(), reads, path)
            queue.wait()
        finally:
            queue.close()
        if digest is not None:
            if digest.hexdigest() != record[digest.key]:
                raise CheckpointError(corrupt_message(path))
            self._verified.add(name)
        aliases = json.loads(header.metadata.get(ALIASES_KEY, "{}"))
        for alias, source in aliases.items():
            tensors[alias] = tensors[source]
        return tensors

    def load_json(self, name: str) -> Any:
        """Read a JSON file of the checkpoint, verifying its checksum."""
        data = (self.directory / name).read_bytes()
        self.check_bytes(name, data)
        return json.loads(data)

    def load_state(self, name: str, into: Any = None) -> Any:
        """Read a nested state written by :meth:`CheckpointWriter.save_state`.

        ``into``: a live state of the same structure (an optimizer's ``state_dict()``) whose tensors are
        filled in place where they match (see :meth:`load_tensors`).
        """
        meta = self.load_json(f"{name}.json")
        targets = _state_tensors(into, name) if into is not None else None
        tensors = self.load_tensors(f"{name}.safetensors", into=targets) if meta.get("has_tensors") else {}
        return decode(meta["tree"], tensors)


def _state_tensors(state: Any, name: str) -> dict[str, torch.Tensor] | None:
    """The tensors of a live nested state under the keys a save of it would use (None if it cannot be saved)."""
    try:
        return encode(state, name)[1]
    except CheckpointError:
        return None


def _fits(target, entry) -> bool:
    return (
        isinstance(target, torch.Tensor)
        and target.device.type == "cpu"
        and target.dtype == entry.dtype
        and tuple(target.shape) == entry.shape
        and target.is_contiguous()
        and not target.is_conj()
        and not target.is_neg()
    )


def read_into(handle, view: memoryview, path: Path | str) -> None:
    """Fill ``view`` from ``handle``'s current position (an unbuffered file: one copy, in pieces of at most 1 GiB).

    Raises:
        CheckpointError: the file ends first (truncated), naming ``path``.
    """
    done = 0
    while done < len(view):
        count = handle.readinto(view[done : done + (1 << 30)])
        if not count:
            raise CheckpointError(f"{path} is truncated: it ended while reading tensor data.")
        done += count


_READ_PIECE = 32 << 20  # a verified file is read in pieces of this size, several at once
_READ_THREADS = max(
    1, min(16, os.cpu_count() or 1)
)  # every core copies (integrity.io_pool): a kernel memcpy from the page cache


def _pread_all(fd: int, reads: list[tuple[int, torch.Tensor]], path: Path) -> None:
    """Read verified tensors' bytes straight into their tensors (``(file offset, tensor)`` pairs): one copy from
    the page cache or the disk. Tensors that follow each other in the file are read by one ``preadv`` into
    their several buffers, in jobs of about ``_READ_PIECE`` bytes spread over a thread per core (``preadv``
    releases the GIL), so that a load from the page cache runs at the memory's speed rather than one core's."""
    jobs, group, group_start, group_end = [], [], 0, -1
    for offset, out in sorted(reads, key=lambda read: read[0]):
        view = memoryview(out.detach().reshape(-1).view(torch.uint8).numpy())
        for start in range(0, len(view), _READ_PIECE):
            piece = view[start : start + _READ_PIECE]
            if group and (
                offset + start != group_end
                or group_end - group_start + len(piece) > _READ_PIECE
                or len(group) >= _MAX_IOVECS
            ):
                jobs.append((group_start, group))
                group = []
            if not group:
                group_start = offset + start
            group.append(piece)
            group_end = offset + start + len(piece)
    if group:
        jobs.append((group_start, group))
    if _READ_THREADS == 1 or len(jobs) < 2:
        for offset, views in jobs:
            _preadv_into(fd, offset, views, path)
        return
    list(
        integrity.io_pool().map(lambda job: _preadv_into(fd, *job, path), jobs)
    )  # list(): the first error is raised here


_MAX_IOVECS = 512  # buffers per preadv call (the kernel takes at most 1024)


def _preadv_into(fd: int, offset: int, views: list[memoryview], path: Path) -> None:
    """Fill ``views``, in order, with the bytes of the file from ``offset`` on."""
    views = [view for view in views if len(view)]
    while views:
        count = os.preadv(fd, views, offset)
        if not count:
            raise CheckpointError(f"{path} is truncated: it ended while reading tensor data.")
        offset += count
        while views and count >= len(views[0]):
            count -= len(views.pop(0))
        if count:
            views[0] = views[0][count:]


def _hash_range(handle, digest: Digest | None, position: int, count: int | None) -> int:
    """Hash ``count`` bytes from ``position`` (all remaining bytes when None); returns the new position."""
    if digest is None:
        if count is not None:
            handle.seek(position + count)
        return position if count is None else position + count
    handle.seek(position)
    remaining = count
    while remaining is None or remaining > 0:
        chunk = handle.read(1 << 24 if remaining is None else min(1 << 24, remaining))
        if not chunk:
            break
        digest.update(chunk)
        position += len(chunk)
        if remaining is not None:
            remaining -= len(chunk)
    return position
