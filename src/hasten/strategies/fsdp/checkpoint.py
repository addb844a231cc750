"""Saving and loading FSDP2 models and optimizers: full state dicts, per-process shards, and merging shards.

Sharded checkpoints (``SHARDED_STATE_DICT``) go through ``torch.distributed.checkpoint`` (DCP): every
process writes its own shards into ``pytorch_model_fsdp_<i>/`` (model ``i``) and
``optimizer_fsdp_<i>/`` (optimizer ``i``) inside the checkpoint folder, and they load back onto any
number of processes. Only tensors go through DCP; the optimizer's other values (learning rates,
betas, ...) are written beside the shards by the checkpoint writer (``optimizer_fsdp_<i>.json``), the
shard files are checked against the checkpoint's manifest before loading, and DCP's ``.metadata``
file is read with an unpickler that only builds DCP's own metadata classes, so loading a checkpoint
never runs pickled code. Full checkpoints (``FULL_STATE_DICT``) gather everything on process 0 and are
written like DDP's (``model.safetensors``, ``optimizer``). Merging the shards offline lives in :mod:`.merging`
(:func:`merge_fsdp_weights`, :func:`read_sharded_model`).

Accelerate's standalone helpers (:func:`save_fsdp_model`, :func:`load_fsdp_model`,
:func:`save_fsdp_optimizer`, :func:`load_fsdp_optimizer`, called by transformers' Trainer) write
Accelerate's file names so checkpoints move between the two: ``pytorch_model_fsdp[_<i>].bin`` and
``optimizer[_<i>].bin`` (full), DCP folders ``pytorch_model_fsdp_<i>/`` and ``optimizer_<i>/`` (sharded),
or per-rank ``..._rank<r>.bin`` files (sharded, ``use_dcp=False``). Their ``.bin`` files are read with
``torch.load(weights_only=True)``; the optimizer's non-tensor values beside DCP shards go into
``optimizer_<i>/optimizer_values.json``.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import json
import pickle
from pathlib import Path

import torch
import torch.distributed as dist

from ...errors import CheckpointError
from ...runtime.wrappers import extract_model_from_parallel, is_compiled_module

FSDP_MODEL_NAME = "pytorch_model_fsdp"
MODEL_SHARDS = FSDP_MODEL_NAME + "_{}"
OPTIMIZER_SHARDS = "optimizer_fsdp_{}"
_METADATA = ".metadata"


def _suffix(index: int) -> str:
    return "" if index == 0 else f"_{index}"


def sharded_root(model) -> torch.nn.Module | None:
    """The FSDP2 module of a prepared model (inside a ``torch.compile`` wrapper if any), or None."""
    from torch.distributed.fsdp import FSDPModule

    inner = model._orig_mod if is_compiled_module(model) else model
    return inner if isinstance(inner, FSDPModule) else None


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _options(**kwargs):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(**kwargs)


# ----------------------------------------------------------------------------------- full state


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict of a sharded model, gathered on process 0 and on the CPU (``{}`` on other processes)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options(full_state_dict=True, cpu_offload=True))


def load_full_model_state(model: torch.nn.Module, state_dict: dict) -> None:
    """Load process 0's full ``state_dict`` into a sharded model (other processes pass ``{}``; it is broadcast)."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, state_dict, options=_options(full_state_dict=True, broadcast_from_rank0=True))


def owner(models: list, optimizer) -> torch.nn.Module | None:
    """The prepared model whose parameters ``optimizer`` updates (None for an optimizer without parameters)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not params:
        return None
    for model in models:
        ids = {id(p) for p in model.parameters()}
        if all(id(p) in ids for p in params):
            return model
    raise CheckpointError(
        "An optimizer updates parameters of several prepared models (or of none); FSDP checkpoints need one model per "
        "optimizer. Use one optimizer per model."
    )


# ----------------------------------------------------------------------------------- sharded state


def _tensor_tree(obj):
    """The nested dicts of ``obj`` keeping only tensor values: what goes through DCP."""
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, dict):
        kept = {key: _tensor_tree(value) for key, value in obj.items()}
        kept = {key: value for key, value in kept.items() if value is not None}
        return kept or None
    return None


def _other_values(obj):
    """``obj`` without the tensors of :func:`_tensor_tree`: what goes into the checkpoint's JSON."""
    if isinstance(obj, dict):
        return {key: _other_values(value) for key, value in obj.items() if not isinstance(value, torch.Tensor)}
    return obj


def _merge(target: dict, saved: dict) -> dict:
    """``target`` (holding the loaded tensors) with the values of ``saved`` put back, dict by dict."""
    merged = dict(target)
    for key, value in saved.items():
        merged[key] = (
            _merge(target[key], value) if isinstance(value, dict) and isinstance(target.get(key), dict) else value
        )
    return merged


class _MetadataUnpickler(pickle.Unpickler):
    """Reads DCP's ``.metadata``, building only DCP's metadata classes and a few torch/pathlib value types."""

    _VALUES = {
        ("torch.serialization", "_get_layout"),
        ("collections", "OrderedDict"),
        ("copyreg", "_reconstructor"),
        ("builtins", "object"),
    }
    _PATHS = {"Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"}
    _DCP_MODULES = {"torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem"}

    def __init__(self, handle, source: Path):
        super().__init__(handle)
        self.source = source

    def find_class(self, module: str, name: str):
        """Return the class ``module.name`` if it is a DCP metadata type; refuse anything else."""
        if module in self._DCP_MODULES:
            found = getattr(importlib.import_module(module), name, None)
            allowed = (dataclasses.is_dataclass(found) and isinstance(found, type)) or isinstance(found, enum.EnumMeta)
        elif module == "torch":
            allowed = name in ("Size", "device") or isinstance(getattr(torch, name, None), torch.dtype)
        else:
            allowed = (module, name) in self._VALUES or (module == "pathlib" and name in self._PATHS)
        if not allowed:
            raise CheckpointError(
                f"{self.source}: the checkpoint metadata refers to {module}.{name}, which is not a DCP metadata type; "
                "refusing to load it (it could run code)."
            )
        return super().find_class(module, name)


def _reader(path: Path):
    """A DCP ``FileSystemReader`` whose metadata is read with :class:`_MetadataUnpickler`."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class _SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            """DCP's metadata, unpickled with :class:`_MetadataUnpickler`."""
            rank = kwargs.get("rank")
            source = Path(self.path) / (_METADATA if rank is None else f"__{rank}{_METADATA}")
            if not source.is_file():
                raise CheckpointError(
                    f"{source.parent} is not a complete sharded checkpoint: {source.name} is missing."
                )
            with open(source, "rb") as handle:
                metadata = _MetadataUnpickler(handle, source).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return _SafeReader(path)


def _save_shards(writer, name: str, key: str, state: dict) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save({key: _tensor_tree(state) or {}}, checkpoint_id=writer.directory / name)
    writer.track(name)
    if writer.is_main:
        writer.save_state(name, _other_values(state))


def _verify_shards(reader, name: str) -> None:
    """Check the shard files against the checkpoint manifest (each process checksums its share, then all agree)."""
    files = sorted(f for f in reader.files if f.startswith(f"{name}/"))
    if not files:
        raise CheckpointError(
            f"Checkpoint {reader.directory} lists no files under {name}/; it was not written by hasten's FSDP strategy."
        )
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    problems = reader.find_corrupt(files[rank::world])
    if world > 1:
        everyone = [None] * world
        dist.all_gather_object(everyone, problems)
        problems = [file for found in everyone for file in found]
    if not problems:
        reader.mark_verified(files)
    if problems:
        raise CheckpointError(
            f"{reader.directory / problems[0]} is corrupt: its checksum does not match the manifest. Restore it from a "
            "backup or use another checkpoint."
        )


def _load_shards(reader, name: str, key: str, target: dict) -> dict:
    import torch.distributed.checkpoint as dcp

    _verify_shards(reader, name)
    try:
        dcp.load({key: _tensor_tree(target) or {}}, storage_reader=_reader(reader.directory / name))
    except CheckpointError:
        raise
    except Exception as error:
        raise CheckpointError(
            f"Could not load the sharded checkpoint {reader.directory / name} into the prepared object: {error}"
        ) from error
    return _merge(target, reader.load_state(name))


def _has_shards(reader, name: str) -> bool:
    return (Path(reader.directory) / name / _METADATA).is_file()


# ----------------------------------------------------------------------------------- checkpoints


def save_model(writer, model, index: int, sharded: bool, get_state_dict) -> None:
    """Write model ``index``: shards in ``pytorch_model_fsdp_<index>/``, or ``model[_<index>].safetensors`` from
    process 0."""
    root = sharded_root(model)
    if root is not None and sharded:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        _save_shards(writer, MODEL_SHARDS.format(index), "model", get_model_state_dict(root))
        return
    state = get_state_dict(model)
    if writer.is_main:
        writer.save_tensors(f"model{_suffix(index)}.safetensors", state)


def load_model(reader, model, index: int) -> None:
    """Restore model ``index`` from whichever form the checkpoint holds (shards or one file)."""
    root = sharded_root(model)
    name = MODEL_SHARDS.format(index)
    if root is not None and _has_shards(reader, name):
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

        set_model_state_dict(root, _load_shards(reader, name, "model", get_model_state_dict(root)))
        return
    if _has_shards(reader, name):
        raise CheckpointError(
            f"{reader.directory} holds model {index} as FSDP shards ({name}/), but that model is not sharded with FSDP "
            "now; load it with FSDP, or merge the shards with `hasten merge-weights`."
        )
    file_name = f"model{_suffix(index)}.safetensors"
    if root is None:
        extract_model_from_parallel(model, keep_torch_compile=False).load_state_dict(reader.load_tensors(file_name))
        return
    load_full_model_state(root, reader.load_tensors(file_name) if _is_main() else {})


def save_optimizer(writer, model, optimizer, index: int, sharded: bool) -> None:
    """Write optimizer ``index``: shards in ``optimizer_fsdp_<index>/`` (+ JSON), or ``optimizer[_<index>]`` from
    process 0."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    optimizer = _unwrap_optimizer(optimizer)
    root = sharded_root(model) if model is not None else None
    if root is None:
        if writer.is_main:
            writer.save_state(f"optimizer{_suffix(index)}", optimizer.state_dict())
        return
    if sharded:
        _save_shards(writer, OPTIMIZER_SHARDS.format(index), "optimizer", get_optimizer_state_dict(root, optimizer))
        return
    state = get_optimizer_state_dict(root, optimizer, options=_options(full_state_dict=True, cpu_offload=True))
    if writer.is_main:
        writer.save_state(f"optimizer{_suffix(index)}", state)


def load_optimizer(reader, model, optimizer, index: int) -> None:
    """Restore optimizer ``index`` from whichever form the checkpoint holds."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    optimizer = _unwrap_optimizer(optimizer)
    root = sharded_root(model) if model is not None else None
    name = OPTIMIZER_SHARDS.format(index)
    if root is None:
        optimizer.load_state_dict(reader.load_state(f"optimizer{_suffix(index)}"))
    elif _has_shards(reader, name):
        set_optimizer_state_dict(
            root, optimizer, _load_shards(reader, name, "optimizer", get_optimizer_state_dict(root, optimizer))
        )
    else:
        state = reader.load_state(f"optimizer{_suffix(index)}") if _is_main() else {}
        set_optimizer_state_dict(
            root, optimizer, state, options=_options(full_state_dict=True, broadcast_from_rank0=True)
        )


def _unwrap_optimizer(optimizer):
    from ...optimizer import AcceleratedOptimizer

    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer


# ----------------------------------------------------------------------------------- Accelerate's helpers

_VALUES = "optimizer_values.json"


def _state_dict_kind(fsdp_plugin) -> str:
    kind = getattr(fsdp_plugin.state_dict_type, "name", fsdp_plugin.state_dict_type)
    if kind not in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
        raise CheckpointError(
            f"state_dict_type={kind!r} cannot be saved with FSDP2; use FULL_STATE_DICT or SHARDED_STATE_DICT."
        )
    return kind


def _root(model) -> torch.nn.Module:
    return sharded_root(model) or extract_model_from_parallel(model, keep_torch_compile=False)


def _adapter_filter(model, adapter_only: bool):
    """With ``adapter_only`` on a peft model: keep the trainable (adapter) entries of a state dict only."""
    inner = extract_model_from_parallel(model, keep_torch_compile=False)
    if not (adapter_only and type(inner).__module__.startswith("peft")):
        return None
    return {name for name, param in inner.named_parameters() if param.requires_grad}


def _save_torch(obj, path: Path) -> None:
    from ...runtime.fileio import atomic_write

    atomic_write(path, lambda tmp: torch.save(obj, tmp))


def _local_tree(obj):
    """``obj`` with every ``DTensor`` replaced by this process's shard (for per-rank files)."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        return obj.to_local().detach().cpu()
    if isinstance(obj, dict):
        return {key: _local_tree(value) for key, value in obj.items()}
    return obj


def _copy_local(target, saved, path: Path):
    """``target`` with this process's shards overwritten by ``saved`` (from :func:`_local_tree`), dict by dict."""
    from torch.distributed.tensor import DTensor

    if isinstance(target, dict) and isinstance(saved, dict):
        return {
            key: _copy_local(value, saved[key], path) if key in saved else value for key, value in target.items()
        } | {key: value for key, value in saved.items() if key not in target}
    if isinstance(target, torch.Tensor) and isinstance(saved, torch.Tensor):
        local = target.to_local() if isinstance(target, DTensor) else target
        if local.shape != saved.shape:
            raise CheckpointError(
                f"{path} holds a shard of shape {tuple(saved.shape)} where this process has {tuple(local.shape)}: "
                "per-rank files load only onto the same number of processes."
            )
        with torch.no_grad():
            local.copy_(saved)
        return target
    return saved


def _load_file(path: Path):
    from ...checkpointing.accelerate_format import load_pickle

    if not path.is_file():
        raise CheckpointError(f"{path} does not exist: nothing was saved there with this state_dict_type and index.")
    return load_pickle(path)


def _agreed_load(path: Path, here: bool):
    """Read ``path`` where ``here`` (``{}`` elsewhere); a failure on any process is raised on every process, never a
    hang."""
    state, problem = {}, None
    if here:
        try:
            state = _load_file(path)
        except CheckpointError as error:
            problem = str(error)
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, problem)
        problem = next((found for found in everyone if found is not None), None)
    if problem is not None:
        raise CheckpointError(problem)
    return state


def _folder(directory, name: str) -> Path:
    directory = Path(directory)
    return directory if directory.name == name else directory / name


def save_fsdp_model(fsdp_plugin, accelerator, model, output_dir, model_index=0, adapter_only=False, use_dcp=True):
    """Save a prepared FSDP model into ``output_dir`` as ``fsdp_plugin.state_dict_type`` says (Accelerate's file names).

    ``FULL_STATE_DICT``: process 0 writes ``pytorch_model_fsdp[_<i>].bin``. ``SHARDED_STATE_DICT``: every
    process writes its shards into ``pytorch_model_fsdp_<i>/`` (DCP), or, with ``use_dcp=False``, into
    ``pytorch_model_fsdp_<i>_rank<r>.bin``. ``adapter_only`` on a peft model keeps its trainable weights
    only. Call it on every process.
    """
    kind, root, output_dir = _state_dict_kind(fsdp_plugin), _root(model), Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    keep = _adapter_filter(model, adapter_only)
    full = kind == "FULL_STATE_DICT"
    state = get_model_state_dict(root, options=_options(full_state_dict=True, cpu_offload=True) if full else None)
    state = {key: value for key, value in state.items() if keep is None or key in keep}
    if full:
        if accelerator.process_index == 0:
            _save_torch(state, output_dir / f"{FSDP_MODEL_NAME}{_suffix(model_index)}.bin")
    elif use_dcp:
        import torch.distributed.checkpoint as dcp

        dcp.save({"model": state}, checkpoint_id=output_dir / MODEL_SHARDS.format(model_index))
    else:
        _save_torch(
            _local_tree(state), output_dir / f"{FSDP_MODEL_NAME}_{model_index}_rank{accelerator.process_index}.bin"
        )
    if dist.is_initialized():
        dist.barrier()


def load_fsdp_model(fsdp_plugin, accelerator, model, input_dir, model_index=0, adapter_only=False, use_dcp=True):
    """Load what :func:`save_fsdp_model` (or Accelerate's) wrote into a prepared FSDP model; returns the
    missing/unexpected keys.

    ``input_dir`` is the folder given to the save (or, for DCP shards, the shards folder itself). Call it
    on every process; the files are read without running pickled code.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    kind, root, input_dir = _state_dict_kind(fsdp_plugin), _root(model), Path(input_dir)
    strict = _adapter_filter(model, adapter_only) is None
    if kind == "FULL_STATE_DICT":
        path = input_dir / f"{FSDP_MODEL_NAME}{_suffix(model_index)}.bin"
        state = _agreed_load(path, _is_main())
        broadcast = dist.is_initialized() and dist.get_world_size() > 1
        return set_model_state_dict(
            root, state, options=_options(full_state_dict=True, broadcast_from_rank0=broadcast, strict=strict)
        )
    target = get_model_state_dict(root)
    if use_dcp:
        folder = _folder(input_dir, MODEL_SHARDS.format(model_index))
        saved = set(_reader(folder).read_metadata().state_dict_metadata)
        wanted = {"model": {key: value for key, value in target.items() if strict or f"model.{key}" in saved}}
        _dcp_load(wanted, folder)
    else:
        path = input_dir / f"{FSDP_MODEL_NAME}_{model_index}_rank{accelerator.process_index}.bin"
        target = _copy_local(target, _agreed_load(path, True), path)
    return set_model_state_dict(root, target, options=_options(strict=strict))


def _dcp_load(wanted: dict, folder: Path) -> None:
    """Load DCP shards into the tensors of ``wanted``, in place (the metadata read without running pickles)."""
    import torch.distributed.checkpoint as dcp

    try:
        dcp.load(wanted, storage_reader=_reader(folder))
    except CheckpointError:
        raise
    except Exception as error:
        raise CheckpointError(
            f"Could not load the sharded checkpoint {folder} into the prepared object: {error}"
        ) from error


def save_fsdp_optimizer(fsdp_plugin, accelerator, optimizer, model, output_dir, optimizer_index=0, use_dcp=True):
    """Save the state of an optimizer of a prepared FSDP model into ``output_dir`` (Accelerate's file names).

    ``FULL_STATE_DICT``: process 0 writes ``optimizer[_<i>].bin``. ``SHARDED_STATE_DICT``: shards in
    ``optimizer_<i>/`` (DCP; the non-tensor values in its ``optimizer_values.json``), or per-rank
    ``optimizer_<i>_rank<r>.bin`` with ``use_dcp=False``. Call it on every process.
    """
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    kind, root, output_dir = _state_dict_kind(fsdp_plugin), _root(model), Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    optimizer = _unwrap_optimizer(optimizer)
    full = kind == "FULL_STATE_DICT"
    state = get_optimizer_state_dict(
        root, optimizer, options=_options(full_state_dict=True, cpu_offload=True) if full else None
    )
    if full:
        if accelerator.process_index == 0:
            _save_torch(state, output_dir / f"optimizer{_suffix(optimizer_index)}.bin")
    elif use_dcp:
        import torch.distributed.checkpoint as dcp

        folder = output_dir / f"optimizer_{optimizer_index}"
        dcp.save({"optimizer": _tensor_tree(state) or {}}, checkpoint_id=folder)
        if accelerator.process_index == 0:
            from ...checkpointing.state_io import encode
            from ...runtime.fileio import atomic_write

            tree, _ = encode(_other_values(state), "optimizer")
            atomic_write(folder / _VALUES, lambda tmp: tmp.write_text(json.dumps(tree)))
    else:
        _save_torch(_local_tree(state), output_dir / f"optimizer_{optimizer_index}_rank{accelerator.process_index}.bin")
    if dist.is_initialized():
        dist.barrier()


def load_fsdp_optimizer(
    fsdp_plugin, accelerator, optimizer, model, input_dir, optimizer_index=0, adapter_only=False, use_dcp=True
):
    """Load what :func:`save_fsdp_optimizer` (or Accelerate's) wrote into the optimizer of a prepared FSDP model.

    Call it on every process. An optimizer folder written by Accelerate has no ``optimizer_values.json``:
    its learning rates and other settings are then kept as they are now (its tensors are loaded).
    """
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    kind, root, input_dir = _state_dict_kind(fsdp_plugin), _root(model), Path(input_dir)
    optimizer = _unwrap_optimizer(optimizer)
    if kind == "FULL_STATE_DICT":
        state = _agreed_load(input_dir / f"optimizer{_suffix(optimizer_index)}.bin", _is_main())
        broadcast = dist.is_initialized() and dist.get_world_size() > 1
        set_optimizer_state_dict(
            root, optimizer, state, options=_options(full_state_dict=True, broadcast_from_rank0=broadcast)
        )
        return
    target = get_optimizer_state_dict(root, optimizer)
    if use_dcp:
        folder = _folder(input_dir, f"optimizer_{optimizer_index}")
        _dcp_load({"optimizer": _tensor_tree(target) or {}}, folder)
        if (folder / _VALUES).is_file():
            from ...checkpointing.state_io import decode

            target = _merge(target, decode(json.loads((folder / _VALUES).read_text()), {}))
    else:
        path = input_dir / f"optimizer_{optimizer_index}_rank{accelerator.process_index}.bin"
        target = _copy_local(target, _agreed_load(path, True), path)
    set_optimizer_state_dict(root, optimizer, target)
