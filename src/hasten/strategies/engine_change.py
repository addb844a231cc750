"""Checkpoints resumed under another engine: single, DDP, FSDP2 and DeepSpeed ZeRO 1-3, in any direction.

Every direction goes through one state by parameter name, :class:`StateByName` (weights, optimizer state, parameter
groups, buffers; it knows no layout), so that nothing is matched by position alone:

* reading: :func:`fill_from_torch_checkpoint` reads a checkpoint a torch optimizer saved (``model.safetensors`` and
  ``optimizer.*``): its state is indexed by position in its groups (one process, DDP), the positions named through
  the live model's parameters in the order the live optimizer holds them and checked against the saved weights'
  names and shapes; or by parameter name (FSDP2's full state dict), checked the same way. An engine keeping its own
  files (ZeRO's partitions, FSDP2's shards) reads them itself: its registration's
  :class:`~hasten.settings.engines.CheckpointReading`, found by :func:`read_other_engine`.
* applying: each engine writes the state into its own layout: :func:`load_state_by_name` into a plain module and
  its torch optimizer (:func:`resume_saved_by_another_engine`, the plain strategies' load), the DeepSpeed and FSDP2
  strategies into their engine (their ``other_engines`` modules).

Everything is checked before anything changes; a mismatch names the parameter. What does not carry over (an engine's
own counters and knobs) is said in one warning line, and otherwise one info line says which engine saved it. This
module imports no engine.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

from ..checkpointing.contents import suffix
from ..errors import CheckpointError
from ..logging import get_logger

_ENGINES = {"DEEPSPEED": "DeepSpeed ZeRO", "FSDP": "FSDP2", "NO": "one process"}


@dataclass
class StateByName:
    """A checkpoint's training state by parameter name, independent of the engine and the processes that saved it.

    Attributes:
        world_size: the processes that saved it.
        folder: where it was read from (for messages).
        weights: every parameter's full weight (fp32 masters under mixed precision; frozen parameters: their saved
            weight), by name. Tied parameters appear once, under the name ``named_parameters()`` gives them.
        optimizer_state: per trained parameter name, the optimizer's state (``exp_avg``, ``exp_avg_sq``,
            ``momentum_buffer``: full tensors of the parameter's shape; ``step`` and other values as saved).
        param_groups: the optimizer's parameter groups: their hyperparameters (``lr``, ``betas``, ...) and under
            ``"params"`` the names of their parameters, in the saving optimizer's order.
        buffers: the module's saved buffers, by name.
        stage: the ZeRO stage that saved it (0 when no ZeRO engine did).
        shared: tied parameter names pointing to the name they share their tensor with.
        engine: a ZeRO engine's own state: ``lr_scheduler`` (its state dict, or None), ``global_steps``,
            ``global_samples``, ``skipped_steps``.
        scaler: a ZeRO engine's fp16 loss scaler (``loss_scaler``, ``dynamic_loss_scale``, ``overflow``).
    """

    world_size: int
    folder: Path
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    optimizer_state: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    param_groups: list[dict] = field(default_factory=list)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    stage: int = 0
    shared: dict[str, str] = field(default_factory=dict)
    engine: dict = field(default_factory=dict)
    scaler: dict = field(default_factory=dict)


def saved_by_torch(reader, index: int) -> bool:
    """Whether the checkpoint holds model ``index`` as a whole state dict (a DDP, FSDP full or one-process save)."""
    return reader.exists(f"model{suffix(index)}.safetensors")


def optimizer_saved_by_name(reader, index: int) -> bool:
    """Whether optimizer ``index`` of the checkpoint names its parameters (FSDP2's full state dict) rather than
    numbering them (a torch optimizer's own ``state_dict``); its tensors are not read."""
    name = f"optimizer{suffix(index)}"
    keys = reader.param_group_keys(name) if reader.exists(f"{name}.json") else None
    return any(isinstance(key, str) for group in keys or [] for key in group)


def saved_under(reader) -> str:
    """The engine and processes that saved the checkpoint, in words (``"FSDP2 on 2 process(es)"``)."""
    manifest = reader.manifest
    engine = str(manifest.get("engine") or "")
    label = _ENGINES.get(engine, "DDP" if engine.startswith("MULTI_") else "another engine")
    return f"{label} on {manifest.get('world_size') or 1} process(es)"


def say_resumed(where: str, source: str, target: str, left: str | None) -> None:
    """The one line of a resume under another engine (``where``: the checkpoint): a warning naming what did not carry
    over (``left``), or, when everything did, an info line."""
    line = (
        f"{where} was saved under {source} and is resumed under {target}: the weights, the optimizer state "
        "(matched by parameter name), schedulers, data positions and random states carry over"
    )
    if left:
        warnings.warn(f"{line}; {left}.", stacklevel=4)
    else:
        get_logger("hasten.checkpointing").info(f"{line}.")


class Found(NamedTuple):
    """A model of the checkpoint to be loaded by parameter name: its ``index``, its ``state`` and what of the saving
    engine's own state does not carry over (``left``, in words; empty when everything does)."""

    index: int
    state: StateByName
    left: str


def find_state_by_name(reader, modules: list, optimizers: list, own: str, native: str | None) -> Found | None:
    """The model of the checkpoint that the loading engine cannot load as it is, read by parameter name.

    That is a model kept in another engine's own files (ZeRO's partitions, FSDP2's shards: the registration that
    claims them reads them), or a whole state dict whose optimizer state is indexed another way than the loading
    engine's own (``native``: ``"position"`` for a torch optimizer, ``"name"`` for FSDP2, None for an engine that
    takes neither).

    Args:
        reader: the open checkpoint.
        modules: the live (unwrapped) models, in the order they were prepared (None: a model to leave to the
            loading engine).
        optimizers: the live optimizers, whose parameter order names a torch optimizer's positions.
        own: the loading engine's registered name (its own files it loads itself).
        native: how the loading engine indexes a saved optimizer state, as above.

    Returns:
        None, having read nothing, when the loading engine loads the checkpoint itself.

    Raises:
        CheckpointError: more than one optimizer, names, shapes or groups that differ (naming the parameter), or a
            damaged file (naming it); nothing was changed.
    """
    from ..environment import ENGINES

    where = f"Checkpoint {reader.directory}"
    for index, module in enumerate(modules):
        if module is None:
            continue
        claim = next((e for e in ENGINES if e.name != own and _claims(e, reader, index)), None)
        if claim is None and not (optimizers and saved_by_torch(reader, index)):
            continue
        if claim is None and native == ("name" if optimizer_saved_by_name(reader, index) else "position"):
            continue
        if len(optimizers) > 1:
            raise CheckpointError(
                f"{where} holds model {index} as {saved_under(reader)} saved it, with one optimizer; this run "
                f"prepared {len(optimizers)} optimizers: prepare one to resume it under another engine. Nothing was "
                "loaded."
            )
        if claim is not None:
            return Found(
                index, claim.checkpoint_reading.read(reader, index, module), claim.checkpoint_reading.left_behind
            )
        state = StateByName(world_size=int(reader.manifest.get("world_size") or 1), folder=reader.directory)
        fill_from_torch_checkpoint(state, reader, index, module, parameter_names(optimizers[0], module), where)
        return Found(index, state, "")
    return None


def _claims(engine, reader, index: int) -> bool:
    return engine.checkpoint_reading is not None and engine.checkpoint_reading.holds(reader, index)


def parameter_names(optimizer, module: torch.nn.Module) -> list[list[str]]:
    """Per parameter group of a torch ``optimizer``, the names in ``module`` of its parameters, in its order."""
    names = {id(param): name for name, param in module.named_parameters()}
    return [[names[id(param)] for param in group["params"]] for group in optimizer.param_groups]


# ------------------------------------------------------------------------------ a torch checkpoint, by name


def fill_from_torch_checkpoint(
    state: StateByName, reader, index: int, module: torch.nn.Module, groups: list[list[str]], where: str
) -> None:
    """Fill ``state`` with the training state of a checkpoint holding a whole state dict and an optimizer's state.

    The optimizer's state is indexed by position in its groups (a torch optimizer's ``state_dict``: the positions
    are named by ``groups``) or by parameter name (FSDP2's full state dict: the names are checked against
    ``groups``).

    Args:
        state: an empty state by name: its weights, buffers, optimizer state and parameter groups are filled.
        reader: the open checkpoint.
        index: which prepared model and optimizer (``model_<index>``, ``optimizer_<index>``).
        module: the live model (its parameter and buffer names and shapes; ZeRO-3's ``ds_shape`` is read).
        groups: per optimizer parameter group, the names of its parameters in the order the live optimizer holds
            them.
        where: the checkpoint, for messages.

    Raises:
        CheckpointError: names, shapes or groups that differ from the live model's and optimizer's, naming the
            parameter; nothing was changed.
    """
    saved = reader.load_tensors(f"model{suffix(index)}.safetensors")
    _check_saved_weights(saved, module, where)
    optimizer = reader.load_state(f"optimizer{suffix(index)}")
    saved_groups = optimizer["param_groups"]
    _check_group_sizes([len(group["params"]) for group in saved_groups], [len(names) for names in groups], where)
    parameters = dict(module.named_parameters())
    state.weights = {name: saved[name].float() for name in parameters}
    state.buffers = {name: saved[name] for name, _ in module.named_buffers() if name in saved}
    canonical = canonical_names(module)
    for position, (saved_group, names) in enumerate(zip(saved_groups, groups)):
        keys = list(saved_group["params"])
        if any(isinstance(key, str) for key in keys):  # saved by parameter name
            named = [canonical.get(key, key) for key in keys]
            _check_group_names(named, names, position, where)
        else:
            named = list(names)
        for key, name in zip(keys, named):
            entry = optimizer["state"].get(key, optimizer["state"].get(str(key), {}))
            _check_state_shapes(entry, name, tuple(state.weights[name].shape), where)
            state.optimizer_state[name] = dict(entry)
        hyper = {key: value for key, value in saved_group.items() if key != "params"}
        state.param_groups.append({**hyper, "params": named})


def canonical_names(module: torch.nn.Module) -> dict[str, str]:
    """Every parameter name of ``module``, tied ones included, to the name ``named_parameters()`` gives its tensor."""
    first: dict[int, str] = {}
    names = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names[name] = first.setdefault(id(param), name)
    return names


def _owned(value, seen: set):
    """``value`` for the optimizer to keep: the state's own tensor the first time, a copy when another parameter's
    entry holds the same tensor (ZeRO keeps one ``step`` per group), which the optimizer would advance twice."""
    if not isinstance(value, torch.Tensor):
        return value
    if id(value) in seen:
        return value.clone()
    seen.add(id(value))
    return value


def _check_group_names(saved: list[str], live: list[str], position: int, where: str) -> None:
    for name in sorted(set(live) - set(saved)):
        raise CheckpointError(
            f"{where} holds no optimizer state for parameter {name!r} in parameter group {position}: create the "
            "optimizer with the same groups as the run that saved it. Nothing was loaded."
        )
    for name in sorted(set(saved) - set(live)):
        raise CheckpointError(
            f"{where} holds optimizer state for parameter {name!r} in parameter group {position}, which this run's "
            "optimizer does not hold there: create the optimizer with the same groups as the run that saved it. "
            "Nothing was loaded."
        )


def _shape(param: torch.Tensor) -> tuple:
    return tuple(getattr(param, "ds_shape", param.shape))


def _check_saved_weights(saved: dict, module: torch.nn.Module, where: str) -> None:
    live = {name: _shape(param) for name, param in module.named_parameters(remove_duplicate=False)}
    live.update({name: tuple(buffer.shape) for name, buffer in module.named_buffers()})
    for name in sorted(live.keys() - saved.keys()):
        raise CheckpointError(f"{where} has no parameter {name!r}, which the model has. Nothing was loaded.")
    for name in sorted(saved.keys() - live.keys()):
        raise CheckpointError(f"{where} holds parameter {name!r}, which the model does not have. Nothing was loaded.")
    for name, shape in live.items():
        if tuple(saved[name].shape) != shape:
            raise CheckpointError(
                f"{where}: parameter {name!r} has shape {tuple(saved[name].shape)} in the checkpoint and {shape} in "
                "the model. Nothing was loaded."
            )


def _check_group_sizes(saved: list[int], live: list[int], where: str) -> None:
    if saved != live:
        raise CheckpointError(
            f"{where} holds an optimizer with parameter groups of {saved} parameters, but this run's optimizer has "
            f"{live}: create the optimizer as the run that saved it did. Nothing was loaded."
        )


def _check_state_shapes(entry: dict, name: str, shape: tuple, where: str) -> None:
    """The optimizer state saved at a parameter's position must have that parameter's shape (else the positions
    do not follow the same parameters)."""
    for key, value in entry.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 1 and tuple(value.shape) != shape:
            raise CheckpointError(
                f"{where}: the optimizer state {key!r} saved for parameter {name!r} has shape {tuple(value.shape)}, "
                f"but the parameter has {shape}: the optimizer holds its parameters in another order than the run "
                "that saved it. Create the optimizer from the same parameters, in the same order. Nothing was loaded."
            )


# ------------------------------------------------------------------------------ by name -> a torch optimizer


def resume_saved_by_another_engine(strategy, reader, models: list, optimizers: list) -> bool:
    """Load a checkpoint that another engine saved (ZeRO's partitions, FSDP2's shards or full state dict) into
    ``strategy``'s plain models and torch optimizers (one process, DDP), by parameter name; the other models are
    loaded whole.

    Returns:
        False, having done nothing, when the checkpoint is a torch optimizer's (the strategy's own load takes it).

    Raises:
        CheckpointError: more than one optimizer, names, shapes or groups that differ (naming the parameter), or a
            damaged checkpoint; nothing was changed.
    """
    targets = [strategy.unwrap_model(model, keep_fp32_wrapper=True, keep_torch_compile=False) for model in models]
    found = find_state_by_name(reader, targets, optimizers, own="", native="position")
    if found is None:
        return False
    where = f"Checkpoint {reader.directory}"
    others = {i: reader.load_tensors(f"model{suffix(i)}.safetensors") for i in range(len(models)) if i != found.index}
    load_state_by_name(found.state, targets[found.index], optimizers, where)
    for i, tensors in others.items():
        targets[i].load_state_dict(tensors)
    if strategy.state.is_main_process:
        target = "DDP" if strategy.state.num_processes > 1 else "one process"
        say_resumed(where, saved_under(reader), f"{target} on {strategy.state.num_processes} process(es)", found.left)
    return True


def load_state_by_name(full, module: torch.nn.Module, optimizers: list, where: str) -> None:
    """Restore a state by parameter name into a plain module and its torch optimizer.

    Args:
        full: the state by name (a :class:`StateByName`).
        module: the unwrapped live model the engine trained.
        optimizers: the prepared optimizers of that model (none, or one).
        where: the checkpoint, for messages.

    Raises:
        CheckpointError: names, shapes or groups that differ, naming the parameter; nothing was changed.
    """
    check_weights(full, module, where)
    states = [torch_optimizer_state(full, module, optimizer, where) for optimizer in optimizers]
    with torch.no_grad():
        for name, param in module.named_parameters():
            param.copy_(full.weights[name])
        buffers = dict(module.named_buffers())
        for name, value in full.buffers.items():
            if name in buffers:
                buffers[name].copy_(value)
    for optimizer, state in zip(optimizers, states):
        optimizer.load_state_dict(state)


def check_weights(full: StateByName, module: torch.nn.Module, where: str) -> None:
    """Refuse a state whose parameter names or shapes are not ``module``'s, naming the first that differs."""
    live = {name: tuple(param.shape) for name, param in module.named_parameters()}
    for name in sorted(live.keys() - full.weights.keys()):
        raise CheckpointError(f"{where} has no parameter {name!r}, which the model has. Nothing was loaded.")
    for name in sorted(full.weights.keys() - live.keys()):
        raise CheckpointError(f"{where} holds parameter {name!r}, which the model does not have. Nothing was loaded.")
    for name, shape in live.items():
        if tuple(full.weights[name].shape) != shape:
            raise CheckpointError(
                f"{where}: parameter {name!r} has shape {tuple(full.weights[name].shape)} in the checkpoint and "
                f"{shape} in the model. Nothing was loaded."
            )


def torch_optimizer_state(full: StateByName, module: torch.nn.Module, optimizer, where: str) -> dict:
    """A torch optimizer state dict for ``optimizer``'s groups, each parameter's state found by its name; a
    parameter without state, or in another group than saved, is refused (naming it)."""
    names = {id(param): name for name, param in module.named_parameters()}
    live_groups = optimizer.param_groups
    if len(live_groups) != len(full.param_groups):
        raise CheckpointError(
            f"{where} holds {len(full.param_groups)} parameter groups; the optimizer has {len(live_groups)}. Create "
            "the optimizer with the same groups as the run that saved it. Nothing was loaded."
        )
    state, groups, position, seen = {}, [], 0, set()
    for live, saved in zip(live_groups, full.param_groups):
        members = set(saved["params"])
        indices = []
        for param in live["params"]:
            name = names.get(id(param))
            if name not in members:
                raise CheckpointError(
                    f"{where} holds no optimizer state for parameter {name!r} in parameter group "
                    f"{len(groups)}: create the optimizer with the same groups as the run that saved it. Nothing "
                    "was loaded."
                )
            state[position] = {key: _owned(value, seen) for key, value in full.optimizer_state[name].items()}
            indices.append(position)
            position += 1
        hyper = {key: value for key, value in live.items() if key != "params"}
        hyper.update({key: value for key, value in saved.items() if key in hyper})
        groups.append({**hyper, "params": indices})
    return {"state": state, "param_groups": groups}
