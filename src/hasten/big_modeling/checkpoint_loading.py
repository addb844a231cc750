"""Reading checkpoints into models: one file, a sharded folder or an index, placed per device map.

Safetensors files are checked (header against size) before anything is loaded, and read tensor by
tensor straight into their destination: the CPU tensors own their memory, tensors for an accelerator
are read there by ``safetensors.safe_open``, and tensors for ``"disk"`` are not read at all (the
offload index points at them in the checkpoint). ``.bin``/``.pt`` files are read only with
``torch.load(weights_only=True)``, which never runs pickled code.
"""

from __future__ import annotations

import json
import pickle
import shutil
import tempfile
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .device_map import check_device_map, device_for
from ..errors import CheckpointError, ConfigError, NotSupportedError
from .modeling import as_device, find_tied_parameters, get_module_tensor, get_tensor_owner, parse_dtype, set_module_tensor_to_device
from .offload import load_offloaded_weights, offload_weight, save_offload_index
from ..runtime.safetensors_io import SafetensorsHeader, read_header, read_tensors

MODEL_NAME = "pytorch_model"
SAFE_MODEL_NAME = "model"
WEIGHTS_NAME = f"{MODEL_NAME}.bin"
SAFE_WEIGHTS_NAME = f"{SAFE_MODEL_NAME}.safetensors"
WEIGHTS_INDEX_NAME = f"{WEIGHTS_NAME}.index.json"
SAFE_WEIGHTS_INDEX_NAME = f"{SAFE_WEIGHTS_NAME}.index.json"
WEIGHTS_PATTERN_NAME = "pytorch_model{suffix}.bin"
SAFE_WEIGHTS_PATTERN_NAME = "model{suffix}.safetensors"
ALIASES_KEY = "hasten_tied_weights"
SAVE_ID_KEY = "hasten_save_id"
_CPU = torch.device("cpu")


class RefusedPickleError(CheckpointError, pickle.UnpicklingError):
    """A torch file holds pickled objects that ``torch.load(weights_only=True)`` refuses (Accelerate's ``load`` raises
    the ``UnpicklingError`` itself)."""


def refused_pickle_error(path, error: Exception) -> CheckpointError:
    """The error for a torch file that ``torch.load(weights_only=True)`` rejected."""
    text = str(error).strip()
    reason = text.splitlines()[-1] if text else type(error).__name__
    return RefusedPickleError(
        f"Refused to load {path}: it contains pickled Python objects other than tensors, and loading it would run "
        f"the code they name ({reason}). hasten only loads such files with torch.load(weights_only=True). If you "
        "trust the file, convert it once: sd = torch.load(path, weights_only=False); "
        "safetensors.torch.save_file(sd, 'model.safetensors') and load the .safetensors file instead."
    )


def _is_safetensors(path: Path) -> bool:
    return path.name.endswith(".safetensors")


def _torch_load(path: Path) -> Mapping:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise refused_pickle_error(path, error) from None
    except (RuntimeError, EOFError, OSError, ValueError) as error:
        raise CheckpointError(f"{path} could not be read as a PyTorch checkpoint ({error}); it is truncated or damaged.") from None
    if not isinstance(state, Mapping):
        raise CheckpointError(f"{path} holds a {type(state).__name__}, not a state dict (a dict of tensor names to tensors).")
    return state


def _aliases(header: SafetensorsHeader) -> dict[str, str]:
    try:
        aliases = json.loads(header.metadata.get(ALIASES_KEY, "{}"))
    except json.JSONDecodeError:
        raise CheckpointError(f"{header.path} has damaged metadata ({ALIASES_KEY} is not JSON); save the model again.") from None
    return dict(aliases)


def _read_on_device(path: Path, names: list[str], device) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device=str(device)) as handle:
        return {name: handle.get_tensor(name) for name in names}


def load_state_dict(checkpoint_file, device_map: Mapping | None = None) -> dict[str, torch.Tensor]:
    """Load one weights file (safetensors or ``.bin``/``.pt``) into a dict of tensors.

    Args:
        checkpoint_file: the file.
        device_map: where to put each tensor (longest-prefix match); tensors mapped to ``"disk"`` are
            left out. Everything goes to the CPU when None.

    Raises:
        CheckpointError: the file is missing, truncated or damaged, or holds pickled objects.
    """
    path = Path(checkpoint_file)
    devices = None if device_map is None else {name: as_device(device) for name, device in device_map.items()}
    if not _is_safetensors(path):
        if not path.is_file():
            raise CheckpointError(f"The checkpoint file {path} does not exist.")
        state = {name: value for name, value in _torch_load(path).items()}
        if devices is None:
            return state
        placed = ((name, value, device_for(name, devices) or _CPU) for name, value in state.items())
        return {name: value.to(device) for name, value, device in placed if device != "disk"}
    header = read_header(path)
    groups: dict = {}
    for name in header.entries:
        device = _CPU if devices is None else device_for(name, devices) or _CPU
        if device != "disk":
            groups.setdefault(device, []).append(name)
    loaded: dict[str, torch.Tensor] = {}
    for device, names in groups.items():
        if device.type == "cpu":
            loaded.update(read_tensors(header, names))
        elif device.type == "meta":
            loaded.update({n: torch.empty(header.entries[n].shape, dtype=header.entries[n].dtype, device="meta") for n in names})
        else:
            loaded.update(_read_on_device(path, names, device))
    result = {name: loaded[name] for name in header.entries if name in loaded}
    for alias, target in _aliases(header).items():
        if target in result:
            result[alias] = result[target]
    return result


@dataclass
class _Checkpoint:
    source: Path
    files: list[Path]
    headers: dict[Path, SafetensorsHeader]
    keys: set[str] | None
    aliases: dict[str, str]


def _pick_in_folder(folder: Path) -> Path:
    for name in (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME):
        if (folder / name).is_file():
            return folder / name
    indexes = sorted(folder.glob("*.index.json"))
    if len(indexes) > 1:
        raise CheckpointError(f"{folder} holds several index files ({', '.join(p.name for p in indexes)}); pass the one to load.")
    if indexes:
        return indexes[0]
    singles = sorted(folder.glob("*.safetensors"))
    if len(singles) == 1:
        return singles[0]
    present = sorted(entry.name for entry in folder.iterdir())
    shown = ", ".join(present[:10]) + (" ..." if len(present) > 10 else "") if present else "nothing"
    raise CheckpointError(
        f"{folder} holds no model weights hasten recognises: expected {SAFE_WEIGHTS_NAME}, {SAFE_WEIGHTS_INDEX_NAME}, "
        f"{WEIGHTS_NAME} or {WEIGHTS_INDEX_NAME} (found: {shown})."
    )


def _check_index(path: Path, weight_map: Mapping, headers: Mapping[Path, SafetensorsHeader], metadata: Mapping) -> None:
    save_id = metadata.get(SAVE_ID_KEY)
    for file, header in headers.items():
        shard_id = header.metadata.get(SAVE_ID_KEY)
        if save_id and shard_id and shard_id != save_id:
            raise CheckpointError(
                f"{file} belongs to a different save than {path} (an interrupted save left old and new shards "
                "together); save the model again."
            )
    for name, file_name in weight_map.items():
        header = headers.get(path.parent / file_name)
        if header is not None and name not in header.entries:
            raise CheckpointError(
                f"The index {path} says {name!r} is in {file_name}, but that file does not hold it; the checkpoint "
                "mixes files from different saves. Save or download it again."
            )


def _from_index(path: Path) -> _Checkpoint:
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"The index {path} is not valid JSON ({error}); it is truncated or damaged: save the model again.") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"The index {path} has no 'weight_map' object mapping weight names to files.")
    files = list(dict.fromkeys(path.parent / name for name in weight_map.values()))
    missing = [file.name for file in files if not file.is_file()]
    if missing:
        raise CheckpointError(
            f"The index {path} lists shard files that are missing: {', '.join(missing)}. The checkpoint is incomplete; "
            "copy or download the missing files, or save the model again."
        )
    metadata = index.get("metadata") or {}
    headers = {file: read_header(file) for file in files if _is_safetensors(file)}
    _check_index(path, weight_map, headers, metadata)
    aliases = dict(metadata.get(ALIASES_KEY) or {})
    for header in headers.values():
        aliases.update(_aliases(header))
    keys = set(weight_map).union(*(header.entries for header in headers.values()))
    return _Checkpoint(path, files, headers, keys, aliases)


def resolve_checkpoint(checkpoint) -> _Checkpoint:
    """Find and check the files of a checkpoint given as a file, a folder or an index file."""
    path = Path(checkpoint)
    if path.is_dir():
        path = _pick_in_folder(path)
    elif not path.exists():
        raise CheckpointError(f"The checkpoint {path} does not exist.")
    if path.name.endswith(".json"):
        return _from_index(path)
    if _is_safetensors(path):
        header = read_header(path)
        return _Checkpoint(path, [path], {path: header}, set(header.entries), _aliases(header))
    return _Checkpoint(path, [path], {}, None, {})


class _ModelLoader:
    """Puts the tensors of one checkpoint into a model, file by file, and reports what did not match."""

    def __init__(self, model: nn.Module, checkpoint: _Checkpoint, device_map, dtype, keep_in_fp32_modules, offload_folder, offload_buffers):
        self.model, self.checkpoint = model, checkpoint
        self.device_map = None if device_map is None else {name: as_device(d) for name, d in device_map.items()}
        self.dtype = parse_dtype(dtype)
        self.keep_fp32 = tuple(keep_in_fp32_modules or ())
        self.offload_folder = None if offload_folder is None else Path(offload_folder)
        self.offload_buffers = offload_buffers
        self.expected = list(model.state_dict(keep_vars=True))
        self.expected_set = set(self.expected)
        self.buffers = {name for name, _ in model.named_buffers(remove_duplicate=False)}
        self.tie_groups = find_tied_parameters(model)
        self.partners = {name: group for group in self.tie_groups for name in group}
        self.alias_of: dict[str, list[str]] = {}
        for alias, target in checkpoint.aliases.items():
            self.alias_of.setdefault(target, []).append(alias)
        self.filled: set[str] = set()
        self.unexpected: list[str] = []
        self.offload_index: dict = {}
        self.ties: list[tuple[str, str]] = []
        self.staging: Path | None = None
        self.staged: dict = {}

    def _targets(self, key: str, all_keys) -> list[str]:
        names = [name for name in (key, *self.alias_of.get(key, ())) if name in self.expected_set]
        for name in list(names):
            names += [m for m in self.partners.get(name, ()) if m not in all_keys and m not in names]
        return names

    def _device(self, name: str):
        if self.device_map is None:
            current = get_module_tensor(self.model, name)
            return _CPU if current.device.type == "meta" else current.device
        device = device_for(name, self.device_map)
        if device == "disk" and name in self.buffers and not self.offload_buffers:
            return _CPU
        return device

    def _dtype(self, name: str, source: torch.dtype) -> torch.dtype | None:
        if self.dtype is None or not source.is_floating_point:
            return None
        dotted = f".{name}."
        if any(f".{module}." in dotted for module in self.keep_fp32):
            return torch.float32
        return self.dtype

    def _assign(self, name: str, value: torch.Tensor, device) -> None:
        current = get_module_tensor(self.model, name)
        dtype = self._dtype(name, value.dtype)
        in_place = current.device.type != "meta" and current.device == device and current.shape == value.shape
        if in_place and (dtype is None or dtype == current.dtype):
            with torch.no_grad():
                current.copy_(value)
        else:
            set_module_tensor_to_device(self.model, name, device, value=value, dtype=dtype, clear_cache=False)

    def _offload(self, name: str, value: torch.Tensor | None, source: tuple[Path, str] | None, source_dtype) -> None:
        dtype = self._dtype(name, source_dtype) or get_module_tensor(self.model, name).dtype
        if source is not None:
            path, key = source
            entry = {"safetensors_file": str(path.resolve()), "weight_name": key, "dtype": str(dtype).removeprefix("torch.")}
            self.offload_index[name] = entry
        else:
            offload_weight(value.to(dtype), name, self.offload_folder, self.offload_index)
        set_module_tensor_to_device(self.model, name, "meta", clear_cache=False)

    def _fill(self, key: str, value, routes: list, source, source_dtype) -> None:
        groups: dict = {}
        for name, device in routes:
            groups.setdefault(device, []).append(name)
        for device, names in groups.items():
            if device == "disk":
                for name in names:
                    self._offload(name, value, source, source_dtype)
                continue
            if self.staging is not None and device == _CPU:
                cast = self._dtype(names[0], value.dtype) or get_module_tensor(self.model, names[0]).dtype
                offload_weight(value.to(cast), names[0], self.staging, self.staged)
            else:
                self._assign(names[0], value, device)
            self.ties += [(other, names[0]) for other in names[1:]]
        self.filled.update(name for name, _ in routes)

    def _routes(self, key: str, all_keys) -> list | None:
        names = self._targets(key, all_keys)
        if not names:
            self.unexpected.append(key)
            return None
        return [(name, self._device(name)) for name in names]

    def load_safetensors(self, path: Path) -> None:
        header = self.checkpoint.headers[path]
        on_cpu, on_device, routes = [], {}, {}
        for key, entry in header.entries.items():
            routes[key] = self._routes(key, self.checkpoint.keys)
            if routes[key] is None:
                continue
            devices = {device for _, device in routes[key] if device != "disk"}
            if not devices:
                self._fill(key, None, routes[key], (path, key), entry.dtype)
            elif len(devices) == 1 and next(iter(devices)).type not in ("cpu", "meta") and self.staging is None:
                on_device.setdefault(next(iter(devices)), []).append(key)
            else:
                on_cpu.append(key)
        for key, value in read_tensors(header, on_cpu):
            self._fill(key, value, routes[key], (path, key), value.dtype)
        for device, keys in on_device.items():
            for key, value in _read_on_device(path, keys, device).items():
                self._fill(key, value, routes[key], (path, key), value.dtype)

    def load_torch(self, path: Path) -> None:
        state = _torch_load(path)
        all_keys = self.checkpoint.keys if self.checkpoint.keys is not None else set(state)
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                self.unexpected.append(key)
                continue
            routes = self._routes(key, all_keys)
            if routes is not None:
                self._fill(key, value, routes, None, value.dtype)

    def _tie(self, name: str, source_name: str) -> None:
        owner, leaf = get_tensor_owner(self.model, name)
        source = get_module_tensor(self.model, source_name)
        if leaf in owner._parameters and isinstance(source, nn.Parameter):
            owner._parameters[leaf] = source
        elif leaf in owner._buffers and not isinstance(source, nn.Parameter):
            owner._buffers[leaf] = source
        else:
            set_module_tensor_to_device(self.model, name, source.device, value=source, clear_cache=False)

    def finish(self, strict: bool) -> None:
        if self.offload_index:
            save_offload_index(self.offload_index, self.offload_folder)
        if self.staged:
            load_offloaded_weights(self.model, self.staged, self.staging)
        for name, source in self.ties:
            self._tie(name, source)
        for group in self.tie_groups:
            devices = {get_module_tensor(self.model, name).device for name in group}
            if len(devices) == 1 and next(iter(devices)).type != "meta":
                for name in group[1:]:
                    self._tie(name, group[0])
        missing = [name for name in self.expected if name not in self.filled]
        _report(self.checkpoint.source, self.model, missing, self.unexpected, strict)


def _report(source: Path, model: nn.Module, missing: list[str], unexpected: list[str], strict: bool) -> None:
    if not missing and not unexpected:
        return

    def show(names: list[str]) -> str:
        return ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")

    parts = ([f"missing keys (left as they were): {show(missing)}"] if missing else []) + (
        [f"unexpected keys (ignored): {show(unexpected)}"] if unexpected else []
    )
    message = f"The checkpoint {source} does not match {type(model).__name__}: " + "; ".join(parts) + "."
    if strict:
        raise CheckpointError(message + " Pass strict=False to load the keys that match.")
    warnings.warn(message, stacklevel=3)


def _has_dtensors(model: nn.Module) -> bool:
    return any(type(param).__name__ == "DTensor" for param in model.parameters())


def _load_distributed(model: nn.Module, checkpoint, full_state_dict: bool, broadcast_from_rank0: bool, strict: bool) -> None:
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
        _report(resolved.source, model, missing, sorted(loaded.difference(expected)), strict)


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
        checkpoint: a weights file (``.safetensors``, ``.bin``, ``.pt``), an index file
            (``*.index.json``) or a folder holding either.
        device_map: ``{name: device}`` (see :mod:`hasten.big_modeling.device_map`). When None, tensors go where the
            model's tensors are (the CPU for meta tensors), in place when device and dtype match.
        offload_folder: folder for tensors mapped to ``"disk"``; required when there are any. Tensors of
            a safetensors checkpoint are not copied there, the offload index points at the checkpoint.
            Offloaded tensors are left on the meta device for :func:`hasten.dispatch_model`.
        dtype: cast floating-point tensors to this dtype (otherwise they take the model's dtype).
        offload_state_dict: pass the CPU tensors through a temporary folder while loading (kept for
            compatibility: hasten already reads one tensor at a time).
        offload_buffers: offload buffers mapped to ``"disk"`` too (they go to the CPU otherwise).
        keep_in_fp32_modules: modules whose floating-point tensors stay in float32 when ``dtype`` is set.
        offload_8bit_bnb: bitsandbytes offloading, not supported by hasten.
        strict: raise on missing or unexpected keys instead of warning.
        full_state_dict: for models with sharded (DTensor) parameters (FSDP2): the checkpoint holds full
            tensors, which each rank slices (through ``torch.distributed.checkpoint.set_model_state_dict``).
        broadcast_from_rank0: in a distributed run, only rank 0 reads the files (the others need not have
            them) and broadcasts the tensors.

    Raises:
        CheckpointError: a file is missing, truncated or damaged, holds pickled objects, or (``strict``)
            the keys do not match the model.
        ConfigError: the device map does not fit the model, or ``"disk"`` is used without ``offload_folder``.
    """
    if offload_8bit_bnb:
        raise NotSupportedError("offload_8bit_bnb (bitsandbytes) is not supported by hasten.")
    if broadcast_from_rank0 or _has_dtensors(model):
        if device_map is not None or dtype is not None:
            raise ConfigError(
                "device_map and dtype cannot be combined with sharded (DTensor) parameters or broadcast_from_rank0: the "
                "checkpoint is copied into the model's own parameters. Cast the model (model.to(dtype)) before loading."
            )
        _load_distributed(model, checkpoint, full_state_dict, broadcast_from_rank0, strict)
        return
    if device_map is not None:
        check_device_map(model, device_map)
        if any(device == "disk" for device in device_map.values()) and offload_folder is None:
            raise ConfigError(
                "The device_map puts modules on 'disk' but no offload_folder was given: pass offload_folder=<a folder> "
                "where hasten may write the offload index."
            )
    loader = _ModelLoader(model, resolve_checkpoint(checkpoint), device_map, dtype, keep_in_fp32_modules, offload_folder, offload_buffers)
    try:
        if offload_state_dict:
            loader.staging = Path(tempfile.mkdtemp(prefix="hasten-staging-", dir=offload_folder))
        for file in loader.checkpoint.files:
            if _is_safetensors(file):
                loader.load_safetensors(file)
            else:
                loader.load_torch(file)
        loader.finish(strict)
    finally:
        if loader.staging is not None:
            shutil.rmtree(loader.staging, ignore_errors=True)
