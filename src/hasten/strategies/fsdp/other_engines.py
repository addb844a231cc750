"""FSDP2's side of a checkpoint resumed under another engine.

Out: :func:`holds_shards` and :func:`read_shards`, the engine registration's
:class:`~hasten.settings.engines.CheckpointReading`: another engine (one process, DDP, DeepSpeed ZeRO) finds a model
kept as FSDP2 shards (``pytorch_model_fsdp_<i>/``, ``optimizer_fsdp_<i>/``) and reads it whole, by parameter name,
every shard file checked against the checkpoint's manifest first. Each process reads the shards itself (no
collective beyond the check), so the number of processes that wrote them does not matter.

In: :func:`resume_by_name` loads into FSDP2 a checkpoint that a torch optimizer saved (one process, DDP: its state
indexed by position, named here through the live optimizer's order) or that DeepSpeed kept in its own files
(:func:`~hasten.strategies.engine_change.find_state_by_name`): every process holds the whole state, cuts its own
shard of each tensor (nothing is sent between processes) and gives it to ``torch.distributed.checkpoint.state_dict``'s
setters.
"""

from __future__ import annotations

import torch

from ...errors import CheckpointError
from ...runtime.wrappers import extract_model_from_parallel
from ..engine_change import (
    StateByName,
    canonical_names,
    check_weights,
    find_state_by_name,
    load_state_by_name,
    saved_under,
    say_resumed,
    torch_optimizer_state,
)
from .checkpoint import MODEL_SHARDS, OPTIMIZER_SHARDS, _has_shards, _options, _unwrap_optimizer, _verify_shards
from .shard_files import read_full_tensors

_STATE = "optimizer.state."


def holds_shards(reader, index: int) -> bool:
    """Whether prepared model ``index`` of an open checkpoint is kept as FSDP2 shards."""
    return _has_shards(reader, MODEL_SHARDS.format(index))


def read_shards(reader, index: int, module: torch.nn.Module) -> StateByName:
    """Model ``index``'s FSDP2 shards and its optimizer's, whole and by parameter name.

    Args:
        reader: the open checkpoint.
        index: which prepared model.
        module: the live model of the loading engine: its parameter names tell the saved parameters from the
            buffers, and tied names are kept once, under the name ``named_parameters()`` gives them.

    Raises:
        CheckpointError: a shard file that does not match the manifest or is missing, naming it; nothing was read
            into the model.
    """
    model_folder = MODEL_SHARDS.format(index)
    _verify_shards(reader, model_folder)
    saved = {key.removeprefix("model."): value for key, value in _read(reader, model_folder).items()}
    canonical = canonical_names(module)
    state = StateByName(world_size=int(reader.manifest.get("world_size") or 1), folder=reader.directory)
    state.weights = {canonical[name]: value.float() for name, value in saved.items() if name in canonical}
    buffers = {name for name, _ in module.named_buffers()}
    state.buffers = {name: value for name, value in saved.items() if name in buffers}
    optimizer_folder = _optimizer_folder(reader, index)
    if optimizer_folder is None:
        return state
    _verify_shards(reader, optimizer_folder)
    tensors = _read(reader, optimizer_folder)
    values = reader.load_state(optimizer_folder)
    for name, entry in (values.get("state") or {}).items():
        prefix = f"{_STATE}{name}."
        moments = {key[len(prefix) :]: value for key, value in tensors.items() if key.startswith(prefix)}
        state.optimizer_state[canonical.get(name, name)] = {**entry, **moments}
    for group in values.get("param_groups") or []:
        state.param_groups.append({**group, "params": [canonical.get(name, name) for name in group["params"]]})
    return state


def _read(reader, folder: str) -> dict[str, torch.Tensor]:
    try:
        return read_full_tensors(reader.directory / folder)
    except CheckpointError:
        raise
    except Exception as error:
        raise CheckpointError(f"Could not read the sharded checkpoint {reader.directory / folder}: {error}") from error


def _optimizer_folder(reader, index: int) -> str | None:
    """The optimizer shards of model ``index``: ``optimizer_fsdp_<index>``, or the only optimizer's."""
    folders = sorted({name.split("/")[0] for name in reader.files if name.startswith("optimizer_fsdp_")})
    own = OPTIMIZER_SHARDS.format(index)
    if own in folders:
        return own
    return folders[0] if len(folders) == 1 else None


def resume_by_name(strategy, reader, models: list, optimizers: list) -> bool:
    """Load a checkpoint of another engine (a torch optimizer's, or ZeRO's files) into FSDP2 models, by name; the
    other models are loaded as FSDP2 loads them.

    Returns:
        False, having done nothing, when the checkpoint is FSDP2's own (shards, or a full state dict whose optimizer
        state is keyed by name): the strategy's own load takes it.

    Raises:
        CheckpointError: more than one optimizer, names, shapes or groups that differ (naming the parameter), or a
            damaged file (naming it); nothing was changed.
    """
    from . import checkpoint

    roots = [checkpoint.sharded_root(model) for model in models]
    plain = [extract_model_from_parallel(model, keep_torch_compile=False) for model in models]
    optimizers = [_unwrap_optimizer(optimizer) for optimizer in optimizers]
    found = find_state_by_name(reader, [r or p for r, p in zip(roots, plain)], optimizers, own="fsdp", native="name")
    if found is None:
        return False
    where = f"Checkpoint {reader.directory}"
    root, state = roots[found.index], found.state
    if root is None:
        load_state_by_name(state, plain[found.index], optimizers, where)
    else:
        check_weights(state, root, where)
        named = [
            _by_name(torch_optimizer_state(state, root, optimizer, where), optimizer, root) for optimizer in optimizers
        ]
        _set_state(root, state, optimizers, named)
    for i, model in enumerate(models):
        if i != found.index:
            checkpoint.load_model(reader, model, i)
    if strategy.state.is_main_process:
        target = f"FSDP2 on {strategy.state.num_processes} process(es)"
        say_resumed(where, saved_under(reader), target, found.left)
    return True


def _by_name(positional: dict, optimizer, module: torch.nn.Module) -> dict:
    """A torch optimizer state dict (indexed by position) keyed by parameter name instead, each tensor of a
    parameter's shape cut into this process's shard of it (as the parameter is)."""
    params = dict(module.named_parameters())
    order = [name for group in optimizer.param_groups for name in _names(group, params)]
    state = {}
    for position, entry in positional["state"].items():
        param = params[order[position]]
        state[order[position]] = {key: _shard_like(value, param) for key, value in entry.items()}
    groups = [{**group, "params": [order[i] for i in group["params"]]} for group in positional["param_groups"]]
    return {"state": state, "param_groups": groups}


def _names(group: dict, params: dict) -> list[str]:
    names = {id(param): name for name, param in params.items()}
    return [names[id(param)] for param in group["params"]]


def _shard_like(value, param: torch.Tensor):
    """``value`` (a whole tensor) as this process's shard of it, laid out as ``param`` is; other values as they are.
    Every process holds the whole tensor, so each takes its shard itself: nothing is sent between processes."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(param, DTensor) or not isinstance(value, torch.Tensor) or value.shape != param.shape:
        return value
    return distribute_tensor(value.detach().to(param.dtype), param.device_mesh, param.placements, src_data_rank=None)


def _set_state(root: torch.nn.Module, state: StateByName, optimizers: list, named: list) -> None:
    """Every process gives its FSDP2 model and optimizers its shard of the whole state it holds."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    params = dict(root.named_parameters())
    weights = {name: _shard_like(state.weights[name], param) for name, param in params.items()}
    weights.update(state.buffers)
    set_model_state_dict(root, weights, options=_options(strict=False))
    for optimizer, optimizer_state in zip(optimizers, named):
        set_optimizer_state_dict(root, optimizer, optimizer_state)
