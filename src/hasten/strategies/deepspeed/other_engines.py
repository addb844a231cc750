"""DeepSpeed's side of a checkpoint resumed under another engine.

In: :func:`resume_torch_checkpoint` loads a checkpoint that a torch optimizer saved (one process, DDP) into a ZeRO
1-3 engine. The checkpoint holds the model's full state dict and the optimizer's state indexed by position in its
groups; the positions are named through the engine's own record of the parameters it was given, in the order the
optimizer held them (ZeRO-1/2: ``bit16_groups``; ZeRO-3: ``trainable_param_groups``), the state is built by
parameter name (:func:`~hasten.strategies.engine_change.fill_from_torch_checkpoint`) and every process takes its
slice of it (:func:`~hasten.strategies.deepspeed.resharding.apply_zero_full_state`).

Out: :func:`holds_engine_state` and :func:`read_engine_state`, the engine registration's
:class:`~hasten.settings.engines.CheckpointReading`, with which another engine finds and reads a ZeRO checkpoint.
"""

from __future__ import annotations

from ...checkpointing.contents import suffix
from ...errors import CheckpointError
from ..engine_change import fill_from_torch_checkpoint, saved_by_torch, warn_left_behind
from .resharding import ZeroFullState, apply_zero_full_state, engine_checkpoint, read_zero_checkpoint

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


def read_engine_state(reader, index: int) -> ZeroFullState:
    """Model ``index``'s ZeRO checkpoint by parameter name (:func:`read_zero_checkpoint`), every file checked."""
    return read_zero_checkpoint(engine_checkpoint(reader, index, CHECKPOINT_FOLDER, TAG).path)


def resume_torch_checkpoint(strategy, reader, models: list) -> bool:
    """Load a checkpoint of a torch optimizer into ``strategy``'s engine (and its other models whole).

    Returns:
        False, having done nothing, when the checkpoint holds the engine's model as DeepSpeed files (or the
        strategy has no engine among ``models``): DeepSpeed's own load or the resharding reader takes it.

    Raises:
        CheckpointError: under ZeRO stage 0, or names, shapes or groups that differ (naming the parameter); nothing
            was changed.
    """
    engine = strategy.engine
    index = next((i for i, model in enumerate(models) if model is engine), -1)
    if index < 0 or holds_engine_state(reader, index) or not saved_by_torch(reader, index):
        return False
    where = f"Checkpoint {reader.directory}"
    stage = engine.zero_optimization_stage()
    if stage not in (1, 2, 3):
        raise CheckpointError(
            f"{where} was saved without DeepSpeed; hasten resumes it under ZeRO stage 1, 2 or 3, and this run uses "
            f"stage {stage}. Set zero_stage to 1, 2 or 3 in the DeepSpeed config. Nothing was loaded."
        )
    state = ZeroFullState(stage=stage, world_size=int(reader.manifest.get("world_size") or 1), folder=reader.directory)
    fill_from_torch_checkpoint(state, reader, index, engine.module, _groups(engine), where)
    state.param_groups = _inner_groups(engine, state.param_groups)
    others = {i: reader.load_tensors(f"model{suffix(i)}.safetensors") for i in range(len(models)) if i != index}
    apply_zero_full_state(engine, state)
    for i, tensors in others.items():
        strategy.unwrap_model(models[i]).load_state_dict(tensors)
    if strategy.state.is_main_process:
        left = "DeepSpeed's step and sample counters start from 0"
        if reader.exists("scaler.json"):
            left += ", and the fp16 gradient scaler's state is not DeepSpeed's loss scaler: it starts afresh"
        warn_left_behind(where, f"a torch optimizer on {state.world_size} process(es)", f"ZeRO-{stage}", left)
    return True


def _groups(engine) -> list[list[str]]:
    """The names of the optimizer's parameters, per group, in the order the optimizer held them."""
    names = {id(param): name for name, param in engine.module.named_parameters()}
    optimizer = engine.optimizer
    if engine.zero_optimization_stage() >= 3:
        return [[names[id(param)] for param in group["params"]] for group in optimizer.trainable_param_groups]
    return [[names[id(param)] for param in group] for group in optimizer.bit16_groups]


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
