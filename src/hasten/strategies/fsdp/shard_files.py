"""The tensors of a ``torch.distributed.checkpoint`` folder read whole in one process, straight from its files.

Used where a sharded checkpoint is needed whole: another engine resuming FSDP2's shards
(:mod:`.other_engines`) and ``hasten merge-weights`` (:mod:`.merging`). ``torch.distributed.checkpoint.load``
would decode every item with ``torch.load`` into a new tensor and copy that into the full one: two copies of the
state besides the file read, which made a resume under another engine cost more than one extra pass over the
state. Here each item's bytes are read from the file straight into its place in the full tensor (one copy), after
its layout is checked: every item is a ``torch.save`` archive of one chunk, whose ``data.pkl`` is read with an
unpickler that builds nothing but the layout (never runs pickled code), and whose storage record is stored
uncompressed, little-endian, of the chunk's dtype and size, and contiguous. An item that is laid out otherwise
(a transform, another serialization) is decoded with ``torch.load(weights_only=True)`` and copied, as DCP does.
"""

from __future__ import annotations

import io
import math
import pickle
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ...checkpointing.files import read_into
from ...errors import CheckpointError
from .checkpoint import _reader

# ``torch.save`` names a storage by its legacy class; only these plain dtypes are read straight into place.
_STORAGE_DTYPES = {
    "FloatStorage": torch.float32,
    "DoubleStorage": torch.float64,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
}
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, (version .. sizes), file name length, extra field length


def read_full_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP folder, whole, under its flattened key (``model.embed.weight``,
    ``optimizer.state.embed.weight.exp_avg``), read in this process alone: nothing is exchanged with other processes,
    whatever number of them wrote the shards.

    Raises:
        CheckpointError: a chunk that no file holds, a file that is missing or ends before an item it holds, an item
            the metadata does not describe, or one that cannot be decoded; naming it.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = _reader(folder).read_metadata()
    entries = {
        key: meta for key, meta in metadata.state_dict_metadata.items() if isinstance(meta, TensorStorageMetadata)
    }
    state = {key: torch.empty(meta.size, dtype=meta.properties.dtype) for key, meta in entries.items()}
    per_file: dict[str, list] = {}
    for index, info in metadata.storage_data.items():
        if index.fqn in state:
            per_file.setdefault(info.relative_path, []).append((index, info))
    _check_complete(folder, entries, per_file)
    for relative_path, items in per_file.items():
        with open(folder / relative_path, "rb", buffering=0) as handle:
            for index, info in sorted(items, key=lambda item: item[1].offset):
                chunk = entries[index.fqn].chunks[_chunk_position(entries[index.fqn], index, folder)]
                region = _region(state[index.fqn], chunk.offsets, chunk.sizes)
                _read_item(handle, info, region, f"{folder / relative_path} (item {index.fqn})")
    return state


def _chunk_position(meta, index, folder: Path) -> int:
    """Which of the tensor's chunks a file's item holds (the metadata's own index when it agrees)."""
    if index.index is not None and index.index < len(meta.chunks):
        if tuple(meta.chunks[index.index].offsets) == tuple(index.offset):
            return index.index
    for position, chunk in enumerate(meta.chunks):
        if tuple(chunk.offsets) == tuple(index.offset):
            return position
    raise CheckpointError(
        f"The sharded checkpoint {folder} is inconsistent: a file holds a chunk of {index.fqn} at offsets "
        f"{tuple(index.offset)} that its metadata does not list. Use another checkpoint."
    )


def _check_complete(folder: Path, entries: dict, per_file: dict) -> None:
    """Every chunk of every tensor is held by a file that exists (otherwise part of a tensor would be left unread)."""
    for relative_path in per_file:
        if not (folder / relative_path).is_file():
            raise CheckpointError(
                f"The sharded checkpoint {folder} is incomplete: {relative_path} is missing. Use another checkpoint."
            )
    held = {(index.fqn, tuple(index.offset)) for items in per_file.values() for index, _ in items}
    for key, meta in entries.items():
        for chunk in meta.chunks:
            if (key, tuple(chunk.offsets)) not in held:
                raise CheckpointError(
                    f"The sharded checkpoint {folder} is incomplete: its metadata lists a chunk of {key} at offsets "
                    f"{tuple(chunk.offsets)} that none of its files holds. Use another checkpoint."
                )
        if sum(math.prod(chunk.sizes) for chunk in meta.chunks) != math.prod(meta.size):
            raise CheckpointError(
                f"The sharded checkpoint {folder} is incomplete: the chunks of {key} do not cover its shape "
                f"{tuple(meta.size)}. Use another checkpoint."
            )


def _region(full: torch.Tensor, offsets, sizes) -> torch.Tensor:
    region = full
    for dim, (offset, size) in enumerate(zip(offsets, sizes)):
        region = region.narrow(dim, offset, size)
    return region


def _read_item(handle, info, region: torch.Tensor, where: str) -> None:
    """One item of a ``.distcp`` file into ``region`` of the full tensor: its bytes straight into place when the
    archive holds exactly that chunk, laid out as it is in memory; otherwise decoded and copied."""
    item = _Window(handle, info.offset, info.length)
    start = None if info.transform_descriptors else _storage_start(item, region)
    if start is not None:
        handle.seek(info.offset + start)
        read_into(handle, memoryview(region.view(-1).view(torch.uint8).numpy()), where)
        return
    item.seek(0)
    try:
        tensor = torch.load(io.BytesIO(item.read()), map_location="cpu", weights_only=True)
    except Exception as error:
        raise CheckpointError(f"{where} cannot be read ({error}). Use another checkpoint.") from error
    if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != tuple(region.shape):
        held = f"a tensor of shape {tuple(tensor.shape)}" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise CheckpointError(
            f"{where} holds {held}, not a tensor of shape {tuple(region.shape)}. Use another checkpoint."
        )
    region.copy_(tensor)


def _storage_start(item: _Window, region: torch.Tensor) -> int | None:
    """Where, in ``item`` (a ``torch.save`` archive), the bytes of ``region`` start; None when the archive holds
    anything but one contiguous, little-endian, uncompressed tensor of ``region``'s dtype and shape, or when
    ``region`` is not contiguous in the full tensor."""
    if not region.is_contiguous():
        return None
    try:
        archive = zipfile.ZipFile(item)
        pickles = [name for name in archive.namelist() if name.rsplit("/", 1)[-1] == "data.pkl"]
        if len(pickles) != 1:
            return None
        prefix = pickles[0][: -len("data.pkl")]
        if archive.read(f"{prefix}byteorder").strip() != b"little":
            return None
        stored = _LayoutUnpickler(io.BytesIO(archive.read(pickles[0]))).load()
        if not isinstance(stored, _Stored) or not stored.holds(region):
            return None
        record = archive.getinfo(f"{prefix}data/{stored.storage_key}")
        if record.compress_type != zipfile.ZIP_STORED or record.file_size != region.numel() * region.element_size():
            return None
        item.seek(record.header_offset)
        signature, name_length, extra_length = _LOCAL_HEADER.unpack(item.read(_LOCAL_HEADER.size))
    except (zipfile.BadZipFile, KeyError, pickle.UnpicklingError, ValueError, TypeError, EOFError, struct.error):
        return None
    if signature != b"PK\x03\x04":
        return None
    return record.header_offset + _LOCAL_HEADER.size + name_length + extra_length


@dataclass
class _Stored:
    """What ``torch.save`` recorded of a tensor: its storage (dtype, record key, element count) and its view."""

    dtype: torch.dtype
    storage_key: str
    storage_numel: int
    storage_offset: int
    size: tuple
    stride: tuple

    def holds(self, region: torch.Tensor) -> bool:
        """Whether this is ``region``'s data exactly: same dtype and shape, the whole storage, contiguous."""
        expected, contiguous = 1, True
        for size, stride in reversed(list(zip(self.size, self.stride))):
            contiguous = contiguous and (size <= 1 or stride == expected)
            expected *= size
        return (
            contiguous
            and self.dtype == region.dtype
            and self.size == tuple(region.shape)
            and self.storage_offset == 0
            and self.storage_numel == region.numel()
        )


def _rebuild_layout(storage, storage_offset, size, stride, *_rest) -> _Stored:
    dtype, key, numel = storage
    return _Stored(dtype, key, int(numel), int(storage_offset), tuple(size), tuple(stride))


class _LayoutUnpickler(pickle.Unpickler):
    """Reads a ``data.pkl`` of one tensor into a :class:`_Stored`, building nothing else: any other global refuses."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_layout
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        raise pickle.UnpicklingError(f"not a plain tensor: {module}.{name}")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], torch.dtype)):
            raise pickle.UnpicklingError("not a plain tensor storage")
        return pid[1], str(pid[2]), pid[4]


class _Window(io.RawIOBase):
    """The bytes ``[start, start + length)`` of an open file, as a file of their own (what ``zipfile`` reads)."""

    def __init__(self, handle, start: int, length: int):
        super().__init__()
        self._handle, self._start, self._length, self._position = handle, start, length, 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._length}[whence]
        self._position = min(max(base + offset, 0), self._length)
        return self._position

    def read(self, size: int = -1) -> bytes:
        left = self._length - self._position
        size = left if size is None or size < 0 else min(size, left)
        self._handle.seek(self._start + self._position)
        chunks, wanted = [], size
        while wanted > 0:
            data = self._handle.read(wanted)
            if not data:
                break
            chunks.append(data)
            wanted -= len(data)
        data = b"".join(chunks)
        self._position += len(data)
        return data
