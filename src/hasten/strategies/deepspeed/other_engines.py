"""DeepSpeed's side of a checkpoint resumed under another engine.

In: :func:`resume_other_engine_checkpoint` loads a checkpoint that a torch optimizer saved (one process, DDP, FSDP2's
full state dict) or that another engine kept in its own files (FSDP2's shards) into a ZeRO 1-3 engine. The state is
read by parameter name (:func:`~hasten.strategies.engine_change.find_state_by_name`; a torch optimizer's positions
are named through the engine's own record of the parameters it was given, in the order the optimizer held them:
ZeRO-1/2 ``bit16_groups``, ZeRO-3 ``trainable_param_groups``) and every process takes its slice of it
(:func:`~hasten.strategies.deepspeed.resharding.apply_zero_full_state`).

Out: :func:`holds_engine_state` and :func:`read_engine_state`, the engine registration's
:class:`~hasten.settings.engines.CheckpointReading`, with which another engine finds and reads a ZeRO checkpoint,
every file checked against the checkpoint's manifest.
"""

from __future__ import annotations

from ...checkpointing.contents import suffix
from ...errors import CheckpointError
from ..engine_change import StateByName, find_state_by_name, saved_by_torch, saved_under, say_resumed
from .checkpoint import verified_loader
from .resharding import apply_zero_full_state, engine_checkpoint, read_zero_checkpoint

CHECKPOINT_FOLDER = "deepspeed"  # where save_state puts the engine's own files
TAG = "state"  # the tag under it


def holds_engine_state(reader, index: int) -> bool:
    """Whether prepared model ``index`` of an open checkpoint is kept as a DeepSpeed engine's files (and not as a
    whole state dict)."""
    if saved_by_torch(reader, index):
        return False
    if reader.manifest.get("format") == "accelerate":
        return (reader.directory / ("pytorch_model" if index == 0 else f"pytorch_model_{index}")).is_dir()
    return any(name.startswith(f"{CHECKPOINT_FOLDER}/") for name in reader.files)


def read_engine_state(reader, index: int, module=None) -> StateByName:
    """Model ``index``'s ZeRO checkpoint by parameter name (:func:`read_zero_checkpoint`), every file checked against
    the checkpoint's manifest (``module`` is not needed: the engine's files name parameters and buffers)."""
    found = engine_checkpoint(reader, index, CHECKPOINT_FOLDER, TAG)
    return read_zero_checkpoint(found.path, verified_loader(None if found.accelerate else reader, mapped=True))


def resume_other_engine_checkpoint(strategy, reader, models: list) -> bool:
    """Load a checkpoint of another engine into ``strategy``'s engine by parameter name (and its other models whole).

    Returns:
        False, having done nothing, when the checkpoint holds the engine's model as DeepSpeed files (or the
        strategy has no engine among ``models``): DeepSpeed's own load or the resharding reader takes it.

    Raises:
        CheckpointError: under ZeRO stage 0, or names, shapes or groups that differ (naming the parameter), or a
            damaged file (naming it); nothing was changed.
    """
    engine = strategy.engine
    modules = [engine.module if model is engine else None for model in models]
    if engine not in models or holds_engine_state(reader, models.index(engine)):
        return False
    where = f"Checkpoint {reader.directory}"
    stage = engine.zero_optimization_stage()
    if stage not in (1, 2, 3):
        raise CheckpointError(
            f"{where} was saved without DeepSpeed; hasten resumes it under ZeRO stage 1, 2 or 3, and this run uses "
            f"stage {stage}. Set zero_stage to 1, 2 or 3 in the DeepSpeed config. Nothing was loaded."
        )
    found = find_state_by_name(reader, modules, [_Groups(engine)], own="deepspeed", native=None)
    if found is None:
        return False
    state = found.state
    state.param_groups = _inner_groups(engine, state.param_groups)
    others = {i: reader.load_tensors(f"model{suffix(i)}.safetensors") for i in range(len(models)) if i != found.index}
    apply_zero_full_state(engine, state)
    for i, tensors in others.items():
        strategy.unwrap_model(models[i]).load_state_dict(tensors)
    if strategy.state.is_main_process:
        left = "DeepSpeed's step and sample counters start from 0"
        if reader.exists("scaler.json"):
            left += ", and the fp16 gradient scaler's state is not DeepSpeed's loss scaler: it starts afresh"
        target = f"ZeRO-{stage} on {engine.dp_world_size} process(es)"
        say_resumed(where, saved_under(reader), target, "; ".join(filter(None, [found.left, left])))
    return True


class _Groups:
    """The engine's optimizer as :func:`~hasten.strategies.engine_change.find_state_by_name` reads one: its parameter
    groups, each listing its parameters in the order the optimizer holds them."""

    def __init__(self, engine):
        self.param_groups = [{"params": params} for params in _params(engine)]


def _params(engine) -> list[list]:
    """The optimizer's parameters, per group, in the order the optimizer held them."""
    optimizer = engine.optimizer
    if engine.zero_optimization_stage() >= 3:
        return [list(group["params"]) for group in optimizer.trainable_param_groups]
    return [list(group) for group in optimizer.bit16_groups]


def _inner_groups(engine, groups: list[dict]) -> list[dict]:
    """The saved groups' hyperparameters per group of the engine's inner optimizer (ZeRO-3 cuts a group into
    sub-groups), keeping the keys that optimizer has."""
    optimizer = engine.optimizer
    owner = getattr(optimizer, "sub_group_to_group_id", None)
    result = []
    for position, live in enumerate(optimizer.optimizer.param_groups):
        saved = groups[owner[position] if owner else position]
        result.append({key: value for key, value in saved.items() if key in live or key == "params"})
    return result
