"""Checkpoints resumed under another engine: a DDP or one-process checkpoint under DeepSpeed ZeRO, and back.

Both directions go through one state by parameter name (weights, optimizer state, parameter groups, buffers; it
knows no layout: :class:`~hasten.strategies.deepspeed.resharding.ZeroFullState`), so that nothing is matched by
position alone:

* :func:`fill_from_torch_checkpoint` reads a checkpoint that a torch optimizer saved (``model.safetensors`` and
  ``optimizer.*``): the optimizer's state is indexed by position in its groups, and the positions are given names
  through the live model's parameters in the order the live optimizer holds them, checked against the saved
  weights' names and shapes. The DeepSpeed strategy applies the state to its engine.
* :func:`resume_saved_by_another_engine` (the plain strategies' load) asks the engine registry
  (:class:`~hasten.settings.engines.CheckpointReading`) whether an engine of its own files saved the checkpoint, has
  it read by name, and restores it into the module and its torch optimizer (:func:`load_state_by_name`): the weights
  from the fp32 masters, an optimizer state dict built by name.

Everything is checked before anything changes; a mismatch names the parameter. What does not carry over (an engine's
own counters and knobs) is said in one warning line. This module imports no engine.
"""

from __future__ import annotations

import warnings

import torch

from ..checkpointing.contents import suffix
from ..errors import CheckpointError


def saved_by_torch(reader, index: int) -> bool:
    """Whether the checkpoint holds model ``index`` as a whole state dict (a DDP, FSDP full or one-process save)."""
    return reader.exists(f"model{suffix(index)}.safetensors")


def warn_left_behind(where: str, source: str, target: str, left: str) -> None:
    """The one warning line of a resume under another engine (``where``: the checkpoint): what did not carry over."""
    warnings.warn(
        f"{where} was saved under {source} and is resumed under {target}: the weights, the optimizer state "
        f"(matched by parameter name), schedulers, data positions and random states carry over; {left}.",
        stacklevel=4,
    )


# ------------------------------------------------------------------------------ torch checkpoint -> ZeRO


def fill_from_torch_checkpoint(
    state, reader, index: int, module: torch.nn.Module, groups: list[list[str]], where: str
) -> None:
    """Fill ``state`` with the training state of a torch optimizer's checkpoint, by parameter name.

    Args:
        state: an empty state by name (a ``ZeroFullState``): its weights, buffers, optimizer state and parameter
            groups are filled.
        reader: the open checkpoint.
        index: which prepared model and optimizer (``model_<index>``, ``optimizer_<index>``).
        module: the live model (its parameter and buffer names and shapes; ZeRO-3's ``ds_shape`` is read).
        groups: per optimizer parameter group, the names of its parameters in the order the optimizer holds them
            (the order the saved optimizer's positions follow).
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
    for saved_group, names in zip(saved_groups, groups):
        for position, name in zip(saved_group["params"], names):
            entry = optimizer["state"].get(position, optimizer["state"].get(str(position), {}))
            _check_state_shapes(entry, name, tuple(state.weights[name].shape), where)
            state.optimizer_state[name] = dict(entry)
        hyper = {key: value for key, value in saved_group.items() if key != "params"}
        state.param_groups.append({**hyper, "params": list(names)})


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


# ------------------------------------------------------------------------------ ZeRO checkpoint -> torch


def resume_saved_by_another_engine(strategy, reader, models: list, optimizers: list) -> bool:
    """Load a checkpoint whose model an engine of its own files saved (DeepSpeed ZeRO) into ``strategy``'s plain
    models and torch optimizers (one process, DDP); the other models are loaded whole.

    Returns:
        False, having done nothing, when no registered engine claims a model of the checkpoint.

    Raises:
        CheckpointError: more than one optimizer for that model, names, shapes or groups that differ (naming the
            parameter), or a damaged checkpoint; nothing was changed.
    """
    from ..environment import ENGINES

    readings = [engine for engine in ENGINES if engine.checkpoint_reading is not None]
    found = next(((i, e) for i in range(len(models)) for e in readings if e.checkpoint_reading.holds(reader, i)), None)
    if found is None:
        return False
    index, engine = found
    where = f"Checkpoint {reader.directory}"
    if len(optimizers) > 1:
        raise CheckpointError(
            f"{where} holds model {index} as a {engine.name} engine's files, with the one optimizer of that engine; "
            f"this run prepared {len(optimizers)} optimizers: prepare one to resume it under another engine. Nothing "
            "was loaded."
        )
    full = engine.checkpoint_reading.read(reader, index)
    targets = [strategy.unwrap_model(model, keep_fp32_wrapper=True, keep_torch_compile=False) for model in models]
    others = {i: reader.load_tensors(f"model{suffix(i)}.safetensors") for i in range(len(models)) if i != index}
    load_state_by_name(full, targets[index], optimizers, where)
    for i, tensors in others.items():
        targets[i].load_state_dict(tensors)
    if strategy.state.is_main_process:
        left = f"the {engine.name} engine's own state (its step and sample counters, loss scaler and config) does not"
        warn_left_behind(where, f"the {engine.name} engine on {full.world_size} process(es)", "a torch optimizer", left)
    return True


def load_state_by_name(full, module: torch.nn.Module, optimizers: list, where: str) -> None:
    """Restore a state by parameter name (a ZeRO checkpoint's) into a plain module and its torch optimizer.

    Args:
        full: the state by name (``read_zero_checkpoint``'s ``ZeroFullState``).
        module: the unwrapped live model the engine trained.
        optimizers: the prepared optimizers of that model (none, or one).
        where: the checkpoint, for messages.

    Raises:
        CheckpointError: names, shapes or groups that differ, naming the parameter; nothing was changed.
    """
    _check_full_weights(full, module, where)
    states = [_torch_optimizer_state(full, module, optimizer, where) for optimizer in optimizers]
    with torch.no_grad():
        for name, param in module.named_parameters():
            param.copy_(full.weights[name])
        buffers = dict(module.named_buffers())
        for name, value in full.buffers.items():
            if name in buffers:
                buffers[name].copy_(value)
    for optimizer, state in zip(optimizers, states):
        optimizer.load_state_dict(state)


def _check_full_weights(full, module: torch.nn.Module, where: str) -> None:
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


def _torch_optimizer_state(full, module: torch.nn.Module, optimizer, where: str) -> dict:
    """A torch optimizer state dict for ``optimizer``'s groups, each parameter's state found by its name."""
    names = {id(param): name for name, param in module.named_parameters()}
    live_groups = optimizer.param_groups
    if len(live_groups) != len(full.param_groups):
        raise CheckpointError(
            f"{where} holds {len(full.param_groups)} parameter groups; the optimizer has {len(live_groups)}. Create "
            "the optimizer with the same groups as the run that saved it. Nothing was loaded."
        )
    state, groups, position = {}, [], 0
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
            state[position] = {
                key: value.clone() if isinstance(value, torch.Tensor) else value
                for key, value in full.optimizer_state[name].items()
            }
            indices.append(position)
            position += 1
        hyper = {key: value for key, value in live.items() if key != "params"}
        hyper.update({key: value for key, value in saved.items() if key in hyper})
        groups.append({**hyper, "params": indices})
    return {"state": state, "param_groups": groups}
