"""``save_state`` / ``load_state``: the whole training state in one self-describing checkpoint folder.

A checkpoint holds, besides the manifest:

* what the strategy writes for the models and optimizers (``model.safetensors``, ``optimizer.*``,
  ``model_1.safetensors``, ... or an engine's sharded files);
* ``scheduler.*``, ``scaler.*`` and ``custom_checkpoint_<i>.*`` (JSON structure + safetensors tensors);
* ``dataloaders.json``: each prepared dataloader's epoch and batches consumed;
* ``random_states_<rank>.*``: every process's python / numpy / torch / CUDA generator states.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..errors import CheckpointError, ConfigError
from ..rng import capture_rng_states, restore_rng_states
from ..state import PartialState, warn_once
from .accelerate_format import open_checkpoint
from .files import CheckpointReader, CheckpointWriter
from .naming import _NAME, checkpoint_path, latest_checkpoint, rotate


@dataclass
class CheckpointContents:
    """The objects a checkpoint saves and restores (built by the ``Accelerator``)."""

    strategy: Any
    models: list = field(default_factory=list)
    optimizers: list = field(default_factory=list)
    schedulers: list = field(default_factory=list)
    dataloaders: list = field(default_factory=list)
    custom_objects: list = field(default_factory=list)
    scaler: Any = None
    step: int = 0
    save_hooks: list[Callable] = field(default_factory=list)
    load_hooks: list[Callable] = field(default_factory=list)


def check_checkpointable(objects) -> None:
    """Raise ``ConfigError`` for objects lacking ``state_dict`` / ``load_state_dict``."""
    bad = [f"#{i} ({type(obj).__name__})" for i, obj in enumerate(objects) if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)))]
    if bad:
        raise ConfigError(
            f"register_for_checkpointing needs objects with state_dict() and load_state_dict(); these have not: {', '.join(bad)}. "
            "Wrap the object in a class that defines both."
        )


def _suffix(index: int) -> str:
    return "" if index == 0 else f"_{index}"


def _target(project, output_dir) -> Path:
    if output_dir is not None:
        return Path(output_dir)
    if not project.automatic_checkpoint_naming:
        raise ConfigError("save_state() needs an output_dir, or Accelerator(project_config=ProjectConfiguration(project_dir=..., automatic_checkpoint_naming=True)).")
    if project.project_dir is None:
        raise ConfigError("automatic_checkpoint_naming needs a project_dir: Accelerator(project_dir=...) or ProjectConfiguration(project_dir=...).")
    path = checkpoint_path(project.project_dir, project.iteration)
    if path.exists():
        raise CheckpointError(
            f"Checkpoint folder {path} already exists (iteration {project.iteration}). Load it with load_state() to "
            "continue the numbering, or set accelerator.project_configuration.iteration to the next free number."
        )
    return path


def save_state(contents: CheckpointContents, project, output_dir=None, safe_serialization: bool = True) -> Path:
    """Write the training state to ``output_dir`` (or the next automatic checkpoint) and return its path."""
    state = PartialState()
    if not safe_serialization:
        warn_once("unsafe-serialization", "save_state(safe_serialization=False) is ignored: hasten checkpoints always store tensors in safetensors and structure in JSON (no pickle).")
    target = _target(project, output_dir)
    on_each_node = project.save_on_each_node
    writer = CheckpointWriter(
        target,
        is_main=state.is_local_main_process if on_each_node else state.is_main_process,
        rank=state.process_index,
        group=state.launch.node_rank if on_each_node else 0,
    )
    writer.begin()
    saved_models = _run_save_hooks(writer, contents)
    contents.strategy.save_checkpoint(writer, contents.models if saved_models is None else [], contents.optimizers)
    if writer.is_main:
        _save_main_process_files(writer, contents)
    meta, tensors = capture_rng_states()
    writer.save_state(f"random_states_{state.process_index}", {"meta": meta, "tensors": tensors})
    info = {
        "world_size": state.num_processes,
        "step": contents.step,
        "iteration": project.iteration if output_dir is None else None,
        "contents": {"models": len(contents.models) if saved_models is None else saved_models, "optimizers": len(contents.optimizers), "schedulers": len(contents.schedulers), "dataloaders": len(contents.dataloaders), "custom_objects": len(contents.custom_objects), "scaler": contents.scaler is not None},
    }
    path = writer.finalize(info)
    if project.automatic_checkpoint_naming and output_dir is None:
        if writer.is_main:
            rotate(project.project_dir, project.total_limit)
        project.iteration += 1
    return path


def _run_save_hooks(writer: CheckpointWriter, contents: CheckpointContents) -> int | None:
    """Run ``register_save_state_pre_hook`` hooks; returns the number of models they left to save (None: no hooks).

    Hooks get ``(models, weights, output_dir)``; ``weights`` are the models' state dicts, which a hook may
    change or remove (e.g. after saving the model in its own format). What is left is written here.
    Under a sharded engine (DeepSpeed, FSDP) the engine writes the weights and ``weights`` is empty.
    """
    if not contents.save_hooks:
        return None
    if not contents.strategy.saves_full_state_dicts:
        for hook in contents.save_hooks:  # the engine writes the weights; hooks can add files beside them
            hook(list(contents.models), [], str(writer.directory))
        return None
    models = list(contents.models)
    weights = [contents.strategy.get_state_dict(model) for model in models]
    for hook in contents.save_hooks:
        hook(models, weights, str(writer.directory))
    if writer.is_main:
        for i, state_dict in enumerate(weights):
            writer.save_tensors(f"model{_suffix(i)}.safetensors", state_dict)
    return len(weights)


def _save_main_process_files(writer: CheckpointWriter, contents: CheckpointContents) -> None:
    for i, scheduler in enumerate(contents.schedulers):
        writer.save_state(f"scheduler{_suffix(i)}", scheduler.state_dict())
    if contents.scaler is not None:
        writer.save_state("scaler", contents.scaler.state_dict())
    writer.save_json("dataloaders.json", [loader.state_dict() for loader in contents.dataloaders])
    for i, obj in enumerate(contents.custom_objects):
        writer.save_state(f"custom_checkpoint_{i}", obj.state_dict())


def _source(project, input_dir) -> Path:
    if input_dir is not None:
        return Path(input_dir)
    if not project.automatic_checkpoint_naming or project.project_dir is None:
        raise ConfigError("load_state() needs an input_dir, unless automatic checkpoint naming is on (ProjectConfiguration(project_dir=..., automatic_checkpoint_naming=True)).")
    latest = latest_checkpoint(project.project_dir)
    if latest is None:
        raise CheckpointError(f"No complete checkpoint in {Path(project.project_dir) / 'checkpoints'} to load.")
    return latest


def _check_counts(reader: CheckpointReader, contents: CheckpointContents, models: int) -> None:
    saved = reader.manifest.get("contents", {})
    now = {"models": models, "optimizers": len(contents.optimizers), "schedulers": len(contents.schedulers), "dataloaders": len(contents.dataloaders), "custom_objects": len(contents.custom_objects)}
    for kind, count in now.items():
        if saved.get(kind, count) != count:
            raise CheckpointError(
                f"Checkpoint {reader.directory} holds {saved[kind]} {kind} but this run prepared {count}: prepare (and "
                "register_for_checkpointing) the same objects, in the same order, as the run that saved it."
            )


def load_state(contents: CheckpointContents, project, input_dir=None) -> tuple[Path, int]:
    """Restore the training state from ``input_dir`` (or the latest automatic checkpoint); returns (path, step)."""
    state = PartialState()
    source = _source(project, input_dir)
    models = list(contents.models)
    reader = open_checkpoint(source, state.process_index, models)  # hasten's format, or a folder Accelerate wrote
    for hook in contents.load_hooks:
        hook(models, str(source))
    _check_counts(reader, contents, len(models))
    contents.strategy.load_checkpoint(reader, models, contents.optimizers)
    for i, scheduler in enumerate(contents.schedulers):
        scheduler.load_state_dict(reader.load_state(f"scheduler{_suffix(i)}"))
    if contents.scaler is not None:
        if not reader.exists("scaler.json"):
            raise CheckpointError(f"Checkpoint {source} has no fp16 scaler state, but this run uses fp16: it was saved with another mixed precision setting.")
        contents.scaler.load_state_dict(reader.load_state("scaler"))
    for loader, position in zip(contents.dataloaders, reader.load_json("dataloaders.json")):
        loader.load_state_dict(position)
    for i, obj in enumerate(contents.custom_objects):
        obj.load_state_dict(reader.load_state(f"custom_checkpoint_{i}"))
    _restore_rng(reader, state)
    match = _NAME.match(source.name)
    if match and project.automatic_checkpoint_naming and input_dir is None:
        project.iteration = int(match.group(1)) + 1
    return source, int(reader.manifest.get("step") or 0)


def _restore_rng(reader: CheckpointReader, state: PartialState) -> None:
    name = f"random_states_{state.process_index}"
    if reader.exists(f"{name}.json"):
        saved = reader.load_state(name)
        restore_rng_states(saved["meta"], saved["tensors"])
        return
    warnings.warn(
        f"Checkpoint {reader.directory} was saved by {reader.manifest.get('world_size')} process(es) and has no random "
        f"state for rank {state.process_index} of this run's {state.num_processes}: this rank's random number "
        "generators are not restored, so dropout and shuffling may differ from the saved run.",
        stacklevel=3,
    )

