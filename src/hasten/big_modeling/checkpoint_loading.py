"""Reading a checkpoint into a model: every tensor put where the device map says, as Accelerate 1.15 puts it.

The result is Accelerate's (dtypes, devices, ties, what goes to disk), read the safe way: files are found and
checked by :mod:`~hasten.big_modeling.checkpoint_files`, safetensors tensors are read one device group at a time,
and tensors mapped to ``"disk"`` from a safetensors file are not read at all: the offload index points at them in
the checkpoint (``.bin`` tensors are written to ``<name>.dat`` files, Accelerate's format).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from ..errors import CheckpointError, ConfigError, NotSupportedError
from .checkpoint_files import (
    CheckpointFiles,
    is_safetensors,
    load_state_dict,
    read_safetensors,
    resolve_checkpoint,
    torch_file,
)
from .modeling import find_tied_parameters, resolve_dtype, retie_parameters
from .offload import offload_weight, save_offload_index
from .placement import check_tied_parameters_on_same_device
from .tensors import as_device, get_module_tensor, set_module_tensor_to_device

logger = logging.getLogger(__name__)
_CPU = torch.device("cpu")


class StrictLoadError(CheckpointError, ValueError, AttributeError):
    """``strict=True`` and the checkpoint's keys do not match the model's.

    Accelerate fails there with whichever error the first odd key leads to (a ``RuntimeError`` from PyTorch's
    ``load_state_dict``, a ``ValueError`` or an ``AttributeError`` when placing it); this error is all three.
    """


def _unknown_device_error(name: str) -> ConfigError:
    return ConfigError(
        f"The device_map gives no device to {name!r}: add an entry for it or one of its modules, or '' for the "
        "whole model."
    )


class _ModelLoader:
    """Puts the tensors of one checkpoint into a model, file by file, remembering what did not match."""

    def __init__(self, model: nn.Module, checkpoint: CheckpointFiles, device_map, dtype, options: dict):
        self.model, self.checkpoint, self.device_map = model, checkpoint, device_map
        self.dtype = dtype
        self.keep_fp32 = options["keep_in_fp32_modules"]
        self.offload_folder = options["offload_folder"]
        self.offload_buffers, self.offload_state_dict = options["offload_buffers"], options["offload_state_dict"]
        self.strict = options["strict"]
        self.model_keys = list(model.state_dict(keep_vars=True))
        self.known = set(self.model_keys)
        self.buffers = {name for name, _ in model.named_buffers()}
        self.alias_of: dict[str, list[str]] = {}
        for alias, target in checkpoint.aliases.items():
            self.alias_of.setdefault(target, []).append(alias)
        self.seen: set[str] = set()
        self.unexpected: list[str] = []
        self.offload_index: dict = {}

    def _names(self, key: str) -> list[str]:
        """The model's names for checkpoint key ``key`` (with the aliases hasten's saver recorded); [] if unexpected."""
        self.seen.add(key)
        names = [name for name in (key, *self.alias_of.get(key, ())) if name in self.known]
        self.seen.update(names)
        if not names and "SCB" not in key:
            self.unexpected.append(key)
            if self.strict:
                raise StrictLoadError(
                    f"The checkpoint {self.checkpoint.source} has {key!r}, which {type(self.model).__name__} "
                    "does not have "
                    "(strict=True). Pass strict=False to load the keys that match."
                )
        return names

    def _device(self, name: str):
        """Accelerate's lookup: the entry of ``name`` or of its closest module in the map, else ``""``'s."""
        probe = name
        while probe and probe not in self.device_map:
            probe = ".".join(probe.split(".")[:-1])
        if probe not in self.device_map:
            raise _unknown_device_error(name)
        return self.device_map[probe]

    def _dtype(self, name: str, value_dtype: torch.dtype):
        """The dtype to load ``name`` in: ``dtype`` for floating-point tensors, float32 for ``keep_in_fp32_modules``
        (only when ``dtype`` is float16, matched as Accelerate matches them: as substrings of the name)."""
        if self.dtype is None or not value_dtype.is_floating_point:
            return None
        if self.keep_fp32 is not None and self.dtype == torch.float16:
            if any((key in name and f"{key}." in name) or key == name for key in self.keep_fp32):
                return torch.float32
        return self.dtype

    def _to_disk(self, name: str, value: torch.Tensor | None, source, value_dtype: torch.dtype) -> None:
        dtype = self._dtype(name, value_dtype) or value_dtype
        set_module_tensor_to_device(self.model, name, "meta", dtype=dtype)
        if source is not None:
            path, key = source
            entry = {
                "safetensors_file": str(path.resolve()),
                "weight_name": key,
                "dtype": str(value_dtype).removeprefix("torch."),
            }
            self.offload_index[name] = entry
        else:
            offload_weight(value, name, self.offload_folder, self.offload_index)

    def _put(self, name: str, value: torch.Tensor) -> None:
        device = self._device(name)
        if device == "disk":  # a buffer of an offloaded module, kept in memory (offload_buffers=False)
            device = "cpu"
        if device == "cpu" and self.offload_state_dict:
            set_module_tensor_to_device(self.model, name, "meta", dtype=self._dtype(name, value.dtype) or value.dtype)
            set_module_tensor_to_device(self.model, name, "cpu", value=value)
            return
        set_module_tensor_to_device(self.model, name, device, value=value, dtype=self._dtype(name, value.dtype))

    def _goes_to_disk(self, name: str) -> bool:
        return self._device(name) == "disk" and (self.offload_buffers or name not in self.buffers)

    def _copy_in_place(self, name: str, value: torch.Tensor) -> None:
        current = get_module_tensor(self.model, name)
        if current.device.type == "meta":
            set_module_tensor_to_device(self.model, name, "cpu", value=value)
            return
        if current.shape != value.shape:
            raise CheckpointError(
                f"size mismatch for {name}: the checkpoint {self.checkpoint.source} holds shape {tuple(value.shape)}, "
                f"the model has {tuple(current.shape)}. Check that the checkpoint matches this model's configuration."
            )
        with torch.no_grad():
            current.copy_(value)

    def load(self, key: str, value: torch.Tensor) -> None:
        """Put checkpoint tensor ``key`` into the model (under each of its names)."""
        for name in self._names(key):
            if self.device_map is None:
                self._copy_in_place(name, value)
            elif self._goes_to_disk(name):
                self._to_disk(name, value, None, value.dtype)
            else:
                self._put(name, value)

    def load_safetensors(self, path: Path) -> None:
        header = self.checkpoint.headers[path]
        groups: dict = {}
        for key, entry in header.entries.items():
            names = self._names(key)
            if self.device_map is None:
                groups.setdefault(_CPU, []).append(key)
                continue
            disk = [name for name in names if self._goes_to_disk(name)]
            for name in disk:
                self._to_disk(name, None, (path, key), entry.dtype)
            others = [name for name in names if name not in disk]
            if others:
                device = self._device(others[0])
                groups.setdefault(_CPU if device == "disk" else as_device(device), []).append(key)
        for key, value in read_safetensors(header, groups).items():
            for name in [n for n in (key, *self.alias_of.get(key, ())) if n in self.known]:
                if self.device_map is None:
                    self._copy_in_place(name, value)
                elif not self._goes_to_disk(name):
                    self._put(name, value)

    def finish(self, tied: list[list[str]]) -> None:
        missing = [name for name in self.model_keys if name not in self.seen]
        if self.strict and missing:
            raise StrictLoadError(
                f"The checkpoint {self.checkpoint.source} lacks {len(missing)} tensors of {type(self.model).__name__} "
                f"(strict=True): {', '.join(missing[:10])}{' ...' if len(missing) > 10 else ''}. "
                "They keep their values; "
                "pass strict=False to accept that."
            )
        if missing:
            logger.warning(
                "The checkpoint %s lacks these tensors of %s, which keep their values: %s",
                self.checkpoint.source,
                type(self.model).__name__,
                missing,
            )
        if self.unexpected:
            logger.warning(
                "Some weights of the checkpoint %s were not used when initializing %s (they are ignored): %s",
                self.checkpoint.source,
                type(self.model).__name__,
                self.unexpected,
            )
        save_offload_index(self.offload_index, self.offload_folder)
        retie_parameters(self.model, tied)


def _has_dtensors(model: nn.Module) -> bool:
    return any(type(param).__name__ == "DTensor" for param in model.parameters())


def _load_distributed(
    model: nn.Module, checkpoint, full_state_dict: bool, broadcast_from_rank0: bool, strict: bool
) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    is_source = not broadcast_from_rank0 or dist.get_rank() == 0
    resolved = resolve_checkpoint(checkpoint) if is_source else None
    files = resolved.files if resolved is not None else []
    if broadcast_from_rank0:
        holder = [len(files)]
        dist.broadcast_object_list(holder, src=0)
        files = files or [None] * holder[0]
    options = StateDictOptions(full_state_dict=full_state_dict, broadcast_from_rank0=broadcast_from_rank0, strict=False)
    expected = list(model.state_dict(keep_vars=True))
    loaded: set[str] = set()
    for file in files:
        state = load_state_dict(file) if file is not None else {}
        loaded.update(state)
        set_model_state_dict(model, state, options=options)
    if resolved is not None:
        tied = {name for group in find_tied_parameters(model) if loaded.intersection(group) for name in group}
        missing = [name for name in expected if name not in loaded and name not in tied]
        unexpected = sorted(loaded.difference(expected))
        if strict and (missing or unexpected):
            raise StrictLoadError(
                f"The checkpoint {resolved.source} does not match {type(model).__name__} (strict=True): missing "
                f"{missing[:10]}, unexpected {unexpected[:10]}. Pass strict=False to load the keys that match."
            )
        if missing or unexpected:
            logger.warning(
                "The checkpoint %s does not match %s: missing keys (left as they were): %s; unexpected keys (ignored): "
                "%s",
                resolved.source,
                type(model).__name__,
                ", ".join(missing),
                ", ".join(unexpected),
            )


def _check_offload_folder(device_map: Mapping | None, offload_folder) -> None:
    if device_map is None or "disk" not in device_map.values():
        return
    if offload_folder is None:
        raise ConfigError(
            "The device_map puts modules on 'disk' but no offload_folder was given: pass offload_folder=<a folder> "
            "where hasten may write the offload index."
        )
    os.makedirs(offload_folder, exist_ok=True)


def load_checkpoint_in_model(
    model: nn.Module,
    checkpoint,
    device_map: Mapping | None = None,
    offload_folder=None,
    dtype: str | torch.dtype | None = None,
    offload_state_dict: bool = False,
    offload_buffers: bool = False,
    keep_in_fp32_modules: list[str] | None = None,
    offload_8bit_bnb: bool = False,
    strict: bool = False,
    full_state_dict: bool = True,
    broadcast_from_rank0: bool = False,
) -> None:
    """Load a checkpoint into ``model``, placing each tensor on the device ``device_map`` gives it.

    Args:
        model: the model; it may be on the meta device (built under :func:`hasten.init_empty_weights`).
        checkpoint: a weights file (``.safetensors``, ``.bin``, ``.pt``), an index file (``*.json``, with or
            without its ``"weight_map"`` wrapper) or a folder holding ``pytorch_model.bin``, ``model.safetensors``
            or one ``*.index.json``.
        device_map: ``{name: device}`` (see :mod:`hasten.big_modeling.device_map`). When None, the checkpoint is
            copied into the model's tensors, which keep their dtype and device (``dtype`` does not apply; tensors
            on the meta device are loaded on the CPU).
        offload_folder: folder for tensors mapped to ``"disk"``; required when there are any. Tensors of a
            safetensors checkpoint are not copied there: the offload index points at the checkpoint. Offloaded
            tensors are left on the meta device, in the dtype they will be loaded in, for :func:`hasten.dispatch_model`.
        dtype: with a device map, cast floating-point tensors to this dtype (otherwise they take the model's
            dtype; tensors offloaded to disk or staged by ``offload_state_dict`` keep the checkpoint's).
        offload_state_dict: tensors for the CPU take the checkpoint's dtype when ``dtype`` is None, as Accelerate
            gives them after staging them on disk (hasten reads one tensor at a time, so it needs no staging).
        offload_buffers: offload buffers mapped to ``"disk"`` too; otherwise they are loaded on the CPU.
        keep_in_fp32_modules: modules whose floating-point tensors are loaded in float32 when ``dtype`` is float16
            (a module matches when its name occurs in the tensor's name followed by a dot).
        offload_8bit_bnb: bitsandbytes offloading, not supported by hasten.
        strict: raise when the checkpoint has a key the model lacks, or lacks one the model has.
        full_state_dict: for models with sharded (DTensor) parameters (FSDP2): the checkpoint holds full
            tensors, which each rank slices (through ``torch.distributed.checkpoint.set_model_state_dict``).
        broadcast_from_rank0: in a distributed run, only rank 0 reads the files (the others need not have
            them) and broadcasts the tensors.

    Raises:
        CheckpointError: a file is missing, truncated or damaged, holds pickled objects, or (``strict``) the keys
            do not match the model (:class:`StrictLoadError`).
        ConfigError: a loaded tensor has no device in ``device_map``, or ``"disk"`` is used without ``offload_folder``.
    """
    if offload_8bit_bnb:
        raise NotSupportedError("offload_8bit_bnb (bitsandbytes) is not supported by hasten.")
    if broadcast_from_rank0 or _has_dtensors(model):
        if device_map is not None or dtype is not None:
            raise ConfigError(
                "device_map and dtype cannot be combined with sharded (DTensor) parameters or broadcast_from_rank0: "
                "the checkpoint is copied into the model's own parameters. Cast the model (model.to(dtype)) before "
                "loading."
            )
        _load_distributed(model, checkpoint, full_state_dict, broadcast_from_rank0, strict)
        return
    tied = find_tied_parameters(model)
    if device_map is not None:
        check_tied_parameters_on_same_device(tied, device_map)
    _check_offload_folder(device_map, offload_folder)
    options = {
        "keep_in_fp32_modules": keep_in_fp32_modules,
        "offload_folder": offload_folder,
        "offload_buffers": offload_buffers,
        "offload_state_dict": offload_state_dict,
        "strict": strict,
    }
    loader = _ModelLoader(model, resolve_checkpoint(checkpoint), device_map, resolve_dtype(dtype), options)
    for file in loader.checkpoint.files:
        if is_safetensors(file):
            loader.load_safetensors(file)
        else:
            for key, value in torch_file(file).items():
                if isinstance(value, torch.Tensor):
                    loader.load(key, value)
    loader.finish(tied)
