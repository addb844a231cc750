"""Weights kept on disk and brought in on demand.

An offload folder holds an ``index.json`` mapping each weight name to where it is, in one of two forms:

* Accelerate's, which :func:`offload_weight` and :func:`offload_state_dict` write (and Accelerate,
  diffusers and peft read): ``{"dtype": ..., "shape": [...]}`` for the raw bytes of the weight in
  ``<name>.dat`` beside the index (bfloat16 stored as int16 and float8 as int8, as numpy lacks them);
* ``{"safetensors_file": ..., "weight_name": ..., "dtype": ...}``: a tensor of a safetensors file,
  which is how :func:`hasten.load_checkpoint_and_dispatch` and transformers' ``from_pretrained``
  offload a safetensors checkpoint without copying it (the path may be absolute, or relative to the folder).

Weights are read back as memory maps of their bytes: nothing is copied into RAM until the weight is
used, and the pages are released with the tensor.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import torch

from ..errors import CheckpointError
from ..runtime.fileio import atomic_write
from ..runtime.weights.safetensors_io import SafetensorsHeader, map_tensor, read_header
from .modeling import find_tied_parameters, parse_dtype, retie_parameters
from .tensors import set_module_tensor_to_device

OFFLOAD_INDEX_NAME = "index.json"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _stored(weight: torch.Tensor) -> tuple[np.ndarray, str]:
    """The bytes of ``weight`` as a numpy array, and the dtype name the index records for them."""
    weight = weight.detach().to("cpu").contiguous()
    name = _dtype_name(weight.dtype)
    if weight.dtype == torch.bfloat16:
        return weight.view(torch.int16).numpy(), name
    if name.startswith("float8_"):
        return weight.view(torch.int8).numpy(), name
    array = weight.numpy()
    return array, str(array.dtype)


def _write_dat(path: Path, array: np.ndarray) -> None:
    if array.ndim == 0:
        array = array[None]
    if array.size == 0:
        path.write_bytes(b"")
        return
    mapped = np.memmap(path, dtype=array.dtype, mode="w+", shape=array.shape)
    mapped[:] = array
    mapped.flush()
    del mapped


def offload_weight(
    weight: torch.Tensor, weight_name: str, offload_folder: str | os.PathLike, index: dict | None = None
) -> dict | None:
    """Write one weight to ``offload_folder/<weight_name>.dat`` (Accelerate's format) and record it in ``index``.

    The file is written atomically (a crash leaves the old file or the new one).

    Args:
        weight: the tensor.
        weight_name: its dotted name in the model.
        offload_folder: the folder (created if needed).
        index: the offload index to update with ``{"dtype": ..., "shape": [...]}`` (nothing is recorded when None).

    Returns:
        ``index``; save it with :func:`save_offload_index`.
    """
    folder = Path(offload_folder)
    folder.mkdir(parents=True, exist_ok=True)
    array, dtype = _stored(weight)
    atomic_write(folder / f"{weight_name}.dat", lambda temporary: _write_dat(temporary, array))
    if index is not None:
        index[weight_name] = {"dtype": dtype, "shape": list(weight.shape)}
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
        raise CheckpointError(
            f"The offload index {path} is not valid JSON ({error}); delete the offload folder and offload again."
        ) from None


def offload_state_dict(save_dir: str | os.PathLike, state_dict: Mapping[str, torch.Tensor]) -> dict:
    """Write every tensor of ``state_dict`` to ``save_dir`` (one ``<name>.dat`` each, plus ``index.json``).

    This is Accelerate's folder format, read by Accelerate, diffusers and peft as well as hasten. Names
    sharing one tensor (tied weights) get one file each, as Accelerate's readers expect.

    Returns:
        The index entries written.
    """
    folder = Path(save_dir)
    folder.mkdir(parents=True, exist_ok=True)
    index: dict = {}
    for name, tensor in state_dict.items():
        offload_weight(tensor, name, folder, index)
    save_offload_index(index, folder)
    return index


def _load_dat(weight_file: Path, weight_info: Mapping) -> torch.Tensor:
    dtype = parse_dtype(weight_info["dtype"])
    shape = tuple(weight_info["shape"])
    if not Path(weight_file).is_file():
        raise CheckpointError(f"The offloaded weights file {weight_file} is missing; the offload folder is incomplete.")
    if math.prod(shape) == 0 and shape:
        return torch.empty(shape, dtype=dtype)
    stored = torch.int16 if dtype == torch.bfloat16 else torch.int8 if str(dtype).startswith("torch.float8_") else dtype
    array = np.memmap(weight_file, dtype=torch.empty((), dtype=stored).numpy().dtype, mode="c", shape=shape or (1,))
    tensor = torch.from_numpy(array)
    if stored != dtype:
        tensor = tensor.view(dtype)
    return tensor.reshape(shape)


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


def load_offloaded_weights(
    model: torch.nn.Module, index: Mapping[str, dict], offload_folder: str | os.PathLike
) -> None:
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

    def __init__(
        self,
        state_dict: Mapping | None = None,
        save_folder: str | os.PathLike | None = None,
        index: Mapping | None = None,
        device=None,
    ):
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
                raise CheckpointError(
                    f"The offload index gives a relative path for {key!r} but no save_folder was given."
                )
            path = self.save_folder / path
        return path

    def _header(self, path: Path) -> SafetensorsHeader:
        try:
            stat = path.stat()
        except FileNotFoundError:
            raise CheckpointError(
                f"The offloaded weights file {path} is missing; the offload folder is incomplete."
            ) from None
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
