"""The safetensors format, read and written without extra copies.

The ``safetensors`` package is the reference implementation; hasten reads and writes the same format
itself where it needs control over the file or the memory:

* writing streams each tensor's bytes straight from its storage into a file object the caller opened
  (so the caller chooses the temporary name, flushes it to disk, or checksums the bytes on the way);
* reading for the CPU copies a tensor's bytes straight from the file into a new tensor, so the result
  owns its memory (no mapping of the file stays behind that a later overwrite of the file could break);
* :func:`map_tensor` maps one tensor of a file (and only that tensor), which is how offloaded weights
  are streamed in: the mapping goes away with the tensor.

A file's header is checked against the file's size before any tensor is read, so a truncated or
damaged file is reported by name (:class:`~hasten.errors.CheckpointError`) instead of failing deep
inside a load.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch

from ...errors import CheckpointError, ConfigError

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    "C64": torch.complex64,
}
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_MAX_HEADER_BYTES = 100 * 2**20  # the limit the safetensors package enforces
_READ_CHUNK = 1 << 30  # a single read() is capped at ~2 GiB on Linux


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies in a safetensors file (``begin``/``end`` are absolute file offsets)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        """Size of the tensor's data in bytes."""
        return self.end - self.begin


@dataclass(frozen=True)
class SafetensorsHeader:
    """The checked header of a safetensors file: its tensors, in file order, and its metadata."""

    path: Path
    entries: dict[str, TensorEntry]
    metadata: dict[str, str]


def _corrupt(path: Path, problem: str) -> CheckpointError:
    return CheckpointError(
        f"{path} is not a valid safetensors file: {problem}. The file is truncated or damaged "
        "(an interrupted save or download?); save or download it again."
    )


def _parse_entry(path: Path, name: str, info, data_start: int) -> TensorEntry:
    if not isinstance(info, dict) or info.get("dtype") not in DTYPES:
        raise _corrupt(path, f"tensor {name!r} has an unknown description {info!r}")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise _corrupt(path, f"tensor {name!r} has an invalid shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
        raise _corrupt(path, f"tensor {name!r} has invalid data_offsets {offsets!r}")
    dtype = DTYPES[info["dtype"]]
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if offsets[0] < 0 or offsets[1] - offsets[0] != expected:
        raise _corrupt(
            path, f"tensor {name!r} of shape {shape} needs {expected} bytes but its offsets {offsets} disagree"
        )
    return TensorEntry(dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1])


def _check_coverage(path: Path, entries: dict[str, TensorEntry], data_start: int, size: int) -> None:
    position = data_start
    for name, entry in sorted(entries.items(), key=lambda item: (item[1].begin, item[1].end)):
        if entry.begin != position:
            raise _corrupt(path, f"tensor {name!r} starts at byte {entry.begin}, expected {position} (gap or overlap)")
        position = entry.end
    if position > size:
        raise _corrupt(path, f"the header describes {position} bytes but the file holds only {size}")
    if position < size:
        raise _corrupt(path, f"{size - position} bytes follow the last tensor")


def read_header(path: str | os.PathLike) -> SafetensorsHeader:
    """Read and check the header of a safetensors file against the file's size.

    Args:
        path: the ``.safetensors`` file.

    Returns:
        The tensors' dtypes, shapes and offsets, and the file's metadata.

    Raises:
        CheckpointError: the file is missing, truncated or its header is damaged (the message names it).
    """
    path = Path(path)
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise _corrupt(path, f"it is {size} bytes long, shorter than the 8-byte header length")
            length = int.from_bytes(prefix, "little")
            if length > min(size - 8, _MAX_HEADER_BYTES):
                raise _corrupt(path, f"its header claims {length} bytes but the file holds {size}")
            raw = handle.read(length)
    except FileNotFoundError:
        raise CheckpointError(f"The checkpoint file {path} does not exist.") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise _corrupt(path, f"its header is not valid JSON ({error})") from None
    if not isinstance(header, dict):
        raise _corrupt(path, "its header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    data_start = 8 + length
    entries = {name: _parse_entry(path, name, info, data_start) for name, info in header.items()}
    _check_coverage(path, entries, data_start, size)
    ordered = dict(sorted(entries.items(), key=lambda item: item[1].begin))
    return SafetensorsHeader(path, ordered, {str(k): str(v) for k, v in metadata.items()})


def _tensor_bytes(tensor: torch.Tensor) -> np.ndarray:
    """The bytes of a tensor as a uint8 array, without a copy when it is a contiguous CPU tensor."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    tensor = tensor.resolve_conj().resolve_neg().contiguous()
    return tensor.reshape(-1).view(torch.uint8).numpy()


def _layout(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None) -> tuple[bytes, list[str]]:
    """The encoded header and the order the tensors' data follow in (widest dtypes first, for alignment)."""
    order = sorted(tensors, key=lambda name: -tensors[name].dtype.itemsize)
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name in order:
        tensor = tensors[name]
        if tensor.dtype not in _DTYPE_NAMES:
            raise CheckpointError(
                f"Tensor {name!r} has dtype {tensor.dtype}, which the safetensors format cannot store; "
                f"convert it to one of {sorted(str(d) for d in _DTYPE_NAMES)} or save with safe_serialization=False."
            )
        nbytes = tensor.numel() * tensor.dtype.itemsize
        header[name] = {
            "dtype": _DTYPE_NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)
    return encoded, order


def safetensors_size(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> int:
    """The size in bytes of the file :func:`write_safetensors` writes for these tensors."""
    encoded, _ = _layout(tensors, metadata)
    return 8 + len(encoded) + sum(tensor.numel() * tensor.dtype.itemsize for tensor in tensors.values())


def write_safetensors(
    handle: BinaryIO, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> int:
    """Write ``tensors`` to an open binary file in the safetensors format, one tensor at a time.

    Only one tensor is ever copied (when it is not a contiguous CPU tensor); the others are written
    from their own storage. The tensors must not overlap in memory (alias them in ``metadata``).

    Args:
        handle: a file opened for binary writing.
        tensors: name -> tensor.
        metadata: string pairs stored in the header's ``__metadata__``.

    Returns:
        The number of bytes written.
    """
    encoded, order = _layout(tensors, metadata)
    handle.write(len(encoded).to_bytes(8, "little"))
    handle.write(encoded)
    written = 8 + len(encoded)
    for name in order:
        if tensors[name].numel():
            data = _tensor_bytes(tensors[name])
            handle.write(memoryview(data))
            written += data.nbytes
    return written


def _read_exactly(handle: BinaryIO, entry: TensorEntry, out: torch.Tensor, path: Path) -> None:
    target = memoryview(out.reshape(-1).view(torch.uint8).numpy())
    handle.seek(entry.begin)
    done = 0
    while done < entry.nbytes:
        count = handle.readinto(target[done : done + _READ_CHUNK])
        if not count:
            raise _corrupt(path, f"it ended while reading tensor data at byte {entry.begin + done}")
        done += count


def read_tensors(header: SafetensorsHeader, names: Iterable[str] | None = None) -> Iterable[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for ``names`` (all tensors by default), read into new CPU tensors.

    The file is read sequentially with plain reads into each tensor's own memory: no mapping of the
    file is kept, so the tensors stay valid if the file is later overwritten or deleted.
    """
    wanted = header.entries if names is None else {name: header.entries[name] for name in names}
    with open(header.path, "rb", buffering=0) as handle:
        for name, entry in sorted(wanted.items(), key=lambda item: item[1].begin):
            out = torch.empty(entry.shape, dtype=entry.dtype)
            if entry.nbytes:
                _read_exactly(handle, entry, out, header.path)
            yield name, out


def map_tensor(header: SafetensorsHeader, name: str) -> torch.Tensor:
    """One tensor of a safetensors file as a copy-on-write memory map of its bytes (nothing is read yet).

    Pages are read from disk when the tensor is used, and the mapping is released when the tensor is
    freed. Writing to the tensor never changes the file.
    """
    entry = header.entries[name]
    if entry.nbytes == 0:
        return torch.empty(entry.shape, dtype=entry.dtype)
    mapped = np.memmap(header.path, dtype=np.uint8, mode="c", offset=entry.begin, shape=(entry.nbytes,))
    return torch.from_numpy(mapped).view(entry.dtype).reshape(entry.shape)


def _view_key(tensor: torch.Tensor) -> tuple:
    storage = tensor.untyped_storage()
    return (
        tensor.device,
        storage.data_ptr(),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.dtype,
    )


def _check_savable(name: str, tensor) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ConfigError(
            f"Cannot save {name!r}: it is a {type(tensor).__name__}, not a tensor. Model weights must be tensors."
        )
    if type(tensor).__name__ == "DTensor":
        raise ConfigError(
            f"Cannot save {name!r}: it is a sharded DTensor. Gather a full state dict first "
            "(Accelerator.get_state_dict(model)) and save that."
        )
    if tensor.device.type == "meta":
        raise CheckpointError(
            f"Cannot save {name!r}: it is on the meta device (offloaded or never loaded), so it has no data. "
            "For a dispatched model, save hasten.big_modeling.get_state_dict_offloaded_model(model) instead."
        )


def dedupe_tensors(state_dict: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Split a state dict into the tensors to write and the aliases of tensors already written.

    Two names are aliases when their tensors are the same view of the same memory (tied weights).

    Returns:
        ``(tensors, aliases)`` where ``aliases`` maps a dropped name to the name it shares memory with.
    """
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, tensor in state_dict.items():
        _check_savable(name, tensor)
        key = _view_key(tensor) if tensor.numel() else None
        if key is not None and key in seen:
            aliases[name] = seen[key]
            continue
        if key is not None:
            seen[key] = name
        tensors[name] = tensor
    return tensors, aliases
