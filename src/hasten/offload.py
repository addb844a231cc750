"""Weights kept on disk and brought in on demand.

An offload folder holds safetensors files and an ``index.json`` mapping each weight name to where it
is: ``{"safetensors_file": ..., "weight_name": ..., "dtype": ...}``. The file may be one written into
the folder (its path is then relative to the folder) or a shard of the original checkpoint (absolute
path), which is how :func:`hasten.load_checkpoint_and_dispatch` offloads a safetensors checkpoint
without copying it. Weights are read back as memory maps of their bytes: nothing is copied into RAM
until the weight is used, and the pages are released with the tensor.

Folders written by Accelerate (``<name>.dat`` files described by ``{"dtype": ..., "shape": ...}``)
are read too.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import torch

from .errors import CheckpointError
from .fileio import atomic_write
from .modeling import find_tied_parameters, parse_dtype, retie_parameters, set_module_tensor_to_device
from .safetensors_io import SafetensorsHeader, dedupe_tensors, map_tensor, read_header, write_safetensors

OFFLOAD_INDEX_NAME = "index.json"
_OFFLOAD_FILE_BYTES = 2**30  # offload_state_dict starts a new file after this many bytes


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _write_file(path: Path, tensors: Mapping[str, torch.Tensor]) -> None:
    with open(path, "wb") as handle:
        write_safetensors(handle, tensors, {"format": "pt"})


def offload_weight(weight: torch.Tensor, weight_name: str, offload_folder: str | os.PathLike, index: dict | None = None) -> dict:
    """Write one weight to ``offload_folder`` (as ``<weight_name>.safetensors``) and record it in ``index``.

    Args:
        weight: the tensor.
        weight_name: its dotted name in the model.
        offload_folder: the folder (created if needed).
        index: the offload index to update (a new dict when None).

    Returns:
        The updated index; save it with :func:`save_offload_index`.
    """
    index = {} if index is None else index
    folder = Path(offload_folder)
    folder.mkdir(parents=True, exist_ok=True)
    file_name = f"{weight_name}.safetensors"
    _write_file(folder / file_name, {weight_name: weight})
    index[weight_name] = {"safetensors_file": file_name, "weight_name": weight_name, "dtype": _dtype_name(weight.dtype)}
    return index


def save_offload_index(index: Mapping[str, dict], offload_folder: str | os.PathLike) -> None:
    """Merge ``index`` into ``offload_folder/index.json`` (written atomically)."""
    if not index:
        return
    path = Path(offload_folder) / OFFLOAD_INDEX_NAME
    merged = read_offload_index(offload_folder)
    merged.update(index)
    text = json.dumps(merged, indent=2)
    atomic_write(path, lambda temporary: temporary.write_text(text, encoding="utf-8"))


def read_offload_index(offload_folder: str | os.PathLike) -> dict:
    """The index of an offload folder (empty when the folder has none)."""
    path = Path(offload_folder) / OFFLOAD_INDEX_NAME
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise CheckpointError(f"The offload index {path} is not valid JSON ({error}); delete the offload folder and offload again.") from None


def offload_state_dict(save_dir: str | os.PathLike, state_dict: Mapping[str, torch.Tensor]) -> dict:
    """Write every tensor of ``state_dict`` to ``save_dir`` (safetensors files plus ``index.json``).

    Tensors are written one at a time into files of about 1 GiB; names sharing one tensor (tied
    weights) are written once and point at the same entry.

    Returns:
        The index entries written.
    """
    folder = Path(save_dir)
    folder.mkdir(parents=True, exist_ok=True)
    stem = f"offload-{uuid.uuid4().hex[:8]}"
    index: dict = {}
    batch: dict[str, torch.Tensor] = {}
    batch_bytes, count = 0, 0

    def flush() -> None:
        nonlocal batch, batch_bytes, count
        if batch:
            count += 1
            file_name = f"{stem}-{count:05d}.safetensors"
            _write_file(folder / file_name, batch)
            for name, tensor in batch.items():
                index[name] = {"safetensors_file": file_name, "weight_name": name, "dtype": _dtype_name(tensor.dtype)}
        batch, batch_bytes = {}, 0

    tensors, aliases = dedupe_tensors(state_dict)
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.dtype.itemsize
        if batch and batch_bytes + size > _OFFLOAD_FILE_BYTES:
            flush()
        batch[name] = tensor
        batch_bytes += size
    flush()
    index.update({alias: dict(index[target]) for alias, target in aliases.items()})
    save_offload_index(index, folder)
    return index


def _load_dat(weight_file: Path, weight_info: Mapping) -> torch.Tensor:
    dtype = parse_dtype(weight_info["dtype"])
    shape = tuple(weight_info["shape"]) or (1,)
    stored = np.int16 if dtype == torch.bfloat16 else torch.empty((), dtype=dtype).numpy().dtype
    array = np.memmap(weight_file, dtype=stored, mode="c", shape=shape)
    tensor = torch.from_numpy(array)
    if dtype == torch.bfloat16:
        tensor = tensor.view(torch.bfloat16)
    return tensor.reshape(tuple(weight_info["shape"]))


def _cast(tensor: torch.Tensor, weight_info: Mapping) -> torch.Tensor:
    wanted = parse_dtype(weight_info.get("dtype"))
    return tensor if wanted is None or tensor.dtype == wanted else tensor.to(wanted)


def load_offloaded_weight(weight_file: str | os.PathLike, weight_info: Mapping) -> torch.Tensor:
    """Map one offloaded weight: from a safetensors file (``weight_info["weight_name"]``) or a ``.dat`` file.

    The result is a memory map of the weight's bytes, cast to ``weight_info["dtype"]`` when that differs.
    """
    weight_file = Path(weight_file)
    if weight_file.suffix == ".safetensors":
        header = read_header(weight_file)
        tensor = map_tensor(header, weight_info.get("weight_name") or next(iter(header.entries)))
    else:
        tensor = _load_dat(weight_file, weight_info)
    return _cast(tensor, weight_info)


def load_offloaded_weights(model: torch.nn.Module, index: Mapping[str, dict], offload_folder: str | os.PathLike) -> None:
    """Load every weight listed in ``index`` back into ``model`` on the CPU (copied into RAM); ties are kept."""
    tied = find_tied_parameters(model)
    loader = OffloadedWeightsLoader(save_folder=offload_folder, index=dict(index))
    for name in index:
        set_module_tensor_to_device(model, name, "cpu", value=loader[name].clone(), clear_cache=False)
    retie_parameters(model, tied)


class OffloadedWeightsLoader(Mapping):
    """A read-only mapping from weight names to tensors, over a state dict and an offload folder.

    Weights in ``state_dict`` are returned as they are; the others are memory-mapped from the files
    the index points to when asked for (and moved to ``device`` when one is given).

    Args:
        state_dict: weights held in memory.
        save_folder: an offload folder; its ``index.json`` is read when ``index`` is None.
        index: an offload index (see the module documentation).
        device: where to put weights read from disk (they stay memory-mapped on the CPU when None).
    """

    def __init__(self, state_dict: Mapping | None = None, save_folder: str | os.PathLike | None = None, index: Mapping | None = None, device=None):
        if state_dict is None and save_folder is None and index is None:
            raise CheckpointError("OffloadedWeightsLoader needs a state_dict, a save_folder or an index.")
        self.state_dict = {} if state_dict is None else state_dict
        self.save_folder = Path(save_folder) if save_folder is not None else None
        if index is None:
            index = read_offload_index(save_folder) if save_folder is not None else {}
        self.index = dict(index)
        self.all_keys = list(self.state_dict) + [key for key in self.index if key not in self.state_dict]
        self.device = device
        self._headers: dict[tuple, SafetensorsHeader] = {}

    def _file(self, info: Mapping, key: str) -> Path:
        if "safetensors_file" in info:
            path = Path(info["safetensors_file"])
        else:
            path = Path(f"{key}.dat")
        if not path.is_absolute():
            if self.save_folder is None:
                raise CheckpointError(f"The offload index gives a relative path for {key!r} but no save_folder was given.")
            path = self.save_folder / path
        return path

    def _header(self, path: Path) -> SafetensorsHeader:
        try:
            stat = path.stat()
        except FileNotFoundError:
            raise CheckpointError(f"The offloaded weights file {path} is missing; the offload folder is incomplete.") from None
        key = (str(path), stat.st_ino, stat.st_mtime_ns, stat.st_size)
        if key not in self._headers:
            self._headers[key] = read_header(path)
        return self._headers[key]

    def __getitem__(self, key: str) -> torch.Tensor:
        if key in self.state_dict:
            return self.state_dict[key]
        info = self.index[key]
        path = self._file(info, key)
        if path.suffix == ".safetensors":
            tensor = _cast(map_tensor(self._header(path), info.get("weight_name", key)), info)
        else:
            tensor = _cast(_load_dat(path, info), info)
        return tensor if self.device is None else tensor.to(self.device)

    def __iter__(self) -> Iterator[str]:
        return iter(self.all_keys)

    def __len__(self) -> int:
        return len(self.all_keys)


class PrefixedDataset(Mapping):
    """The entries of a mapping whose keys start with ``prefix``, seen without the prefix."""

    def __init__(self, dataset: Mapping, prefix: str):
        self.dataset = dataset
        self.prefix = prefix

    def __getitem__(self, key: str):
        return self.dataset[f"{self.prefix}{key}"]

    def __iter__(self) -> Iterator[str]:
        return (key[len(self.prefix) :] for key in self.dataset if key.startswith(self.prefix))

    def __len__(self) -> int:
        return sum(1 for _ in self)


def extract_submodules_state_dict(state_dict: Mapping[str, torch.Tensor], submodule_names: list[str]) -> dict:
    """The entries of ``state_dict`` that belong to one of ``submodule_names`` (``""`` is the whole model)."""
    prefixes = [f"{name}." for name in submodule_names if name]
    whole = "" in submodule_names
    return {
        key: value
        for key, value in state_dict.items()
        if whole or key in submodule_names or any(key.startswith(prefix) for prefix in prefixes)
    }
