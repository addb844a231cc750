"""``save_state`` / ``load_state``: the whole training state in one self-describing checkpoint folder.

A checkpoint holds, besides the manifest:

* what the strategy writes for the models and optimizers (``model.safetensors``, ``optimizer.*``,
  ``model_1.safetensors``, ... or an engine's sharded files);
* ``scheduler.*``, ``scaler.*`` and ``custom_checkpoint_<i>.*`` (JSON structure + safetensors tensors);
* ``dataloaders.json``: each prepared dataloader's epoch, position in samples of the epoch's global order and
  the random states its epoch started from (``load_state`` restores the position only with
  ``DataLoaderConfiguration(use_stateful_dataloader=True)``, as Accelerate does; otherwise the epoch and
  those states, so that a loop skipping its first batches resumes exactly);
* ``random_states_<rank>.*``: every process's python / numpy / torch / CUDA generator states.
"""

from __future__ import annotations

import os
import time
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..errors import CheckpointError, ConfigError
from ..runtime.operations import gather_object
from ..runtime.rng import capture_rng_states, restore_rng_states
from ..state import PartialState, warn_once
from . import participants
from .accelerate_format import open_checkpoint
from .background import side_group, start_waiting, wait_for_pending_save
from .background import start as start_background_save
from .files import CheckpointReader, CheckpointWriter
from .integrity import corrupt_message
from .manifest import read_manifest
from .naming import _NAME, checkpoint_path, latest_checkpoint, rotate
from .parts import add_random_states
from .publishing import finish_interrupted, resolve_target
from .world_change import random_state_for


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
    restore_dataloader_positions: bool = False


def check_checkpointable(objects) -> None:
    """Raise ``ConfigError`` for objects lacking ``state_dict`` / ``load_state_dict``."""
    bad = [
        f"Item at index {i}, `{type(obj).__name__}`"
        for i, obj in enumerate(objects)
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)))
    ]
    if bad:
        raise ConfigError(
            "register_for_checkpointing needs objects with state_dict() and load_state_dict(); these have not: "
            f"{'; '.join(bad)}. Wrap the object in a class that defines both."
        )


def _suffix(index: int) -> str:
    return "" if index == 0 else f"_{index}"


def _target(project, output_dir, check_free: bool = True) -> Path:
    if output_dir is not None:
        return resolve_target(output_dir)
    if not project.automatic_checkpoint_naming:
        raise ConfigError(
            "save_state() needs an output_dir, or Accelerator(project_config=ProjectConfiguration(project_dir=..., "
            "automatic_checkpoint_naming=True))."
        )
    if project.project_dir is None:
        raise ConfigError(
            "automatic_checkpoint_naming needs a project_dir: Accelerator(project_dir=...) or "
            "ProjectConfiguration(project_dir=...)."
        )
    path = checkpoint_path(project.project_dir, project.iteration)
    if check_free and path.exists():
        raise CheckpointError(
            f"Checkpoint folder {path} already exists (iteration {project.iteration}). Load it with load_state() to "
            "continue the numbering, or set accelerator.project_configuration.iteration to the next free number."
        )
    return path


def save_state(
    contents: CheckpointContents,
    project,
    output_dir=None,
    safe_serialization: bool = True,
    async_save: bool | None = None,
) -> Path:
    """Write the training state to ``output_dir`` (or the next automatic checkpoint) and return its path.

    Under a replicated engine (one process, DDP) it works whether every process calls it or the main
    process alone and enters no collective. The main process waits for the others (boundedly) only when they
    took part in an earlier save of this run, so a run that saves from the main process alone never waits; a
    process that comes after the main process closed its door adds its random states to the published
    checkpoint itself; a process given
    another folder than the main process's writes a complete checkpoint of its own there. Under a sharded
    engine every process must call it, with the same folder (see :mod:`.participants`). ``async_save``
    (default: ``project.async_save``) copies the state and returns; the files are written, fsynced and published
    by a background thread (see ``background.py``). A folder that holds other files keeps them (see
    ``publishing.py``).
    """
    wait_for_pending_save()
    state = PartialState()
    if not safe_serialization:
        warn_once(
            "unsafe-serialization",
            "save_state(safe_serialization=False) is ignored: hasten checkpoints always store tensors in safetensors "
            "and structure in JSON (no pickle).",
        )
    asynchronous = _asynchronous(contents, project, async_save)
    on_each_node = project.save_on_each_node
    is_writer = state.is_local_main_process if on_each_node else state.is_main_process
    sharded = contents.strategy.save_needs_every_process and state.num_processes > 1
    started = time.monotonic()
    target = _target(project, output_dir, check_free=is_writer or sharded)
    if sharded:
        participants.check_attendance(
            target.absolute(), state.process_index, state.num_processes, type(contents.strategy).__name__
        )

    def new_writer(writes: bool) -> CheckpointWriter:
        live = _live_memory(contents) if asynchronous else frozenset()
        group = state.launch.node_rank if on_each_node else 0
        return CheckpointWriter(
            target,
            is_main=writes,
            rank=state.process_index,
            group=group,
            solo=not sharded,
            snapshot=asynchronous,
            live=live,
        )

    writer = new_writer(is_writer)
    returned = target if output_dir is None else Path(output_dir)
    own_folder = False
    if not sharded and not is_writer:
        own_folder = (
            _hand_over(writer, contents, state, asynchronous, _writer_rank(state, on_each_node))
            == participants.ELSEWHERE
        )
        if not own_folder:
            _count_iteration(project, output_dir)
            return returned
        writer = new_writer(True)  # the writer saves elsewhere: this process's folder gets its own checkpoint
    others = [] if sharded or own_folder else _folder_peers(writer, state, on_each_node)
    _write_and_publish(writer, contents, project, output_dir, others, started, asynchronous, sharded)
    _count_iteration(project, output_dir)
    return returned


def _write_and_publish(
    writer: CheckpointWriter,
    contents: CheckpointContents,
    project,
    output_dir,
    others: list[int],
    started: float,
    asynchronous: bool,
    sharded: bool,
) -> None:
    """On a writing process: write every file, collect the random states of ``others`` (the processes whose
    states belong in this folder), then publish, now or in the background."""
    state = PartialState()
    record = (
        (state.process_index, participants.open_record(writer.final, contents.step, state.process_index))
        if others
        else None
    )

    def after_failure(error: BaseException) -> None:
        if others:
            participants.announce_failed(writer.final, contents.step, others, _one_line(error, writer.final))

    writer.begin()
    if others:
        participants.announce_begun(writer.final, contents.step)
    try:
        saved_models = _write_contents(writer, contents, state)
    except BaseException as error:
        writer.discard()
        if record:
            participants.close_record(writer.final, contents.step, *record, [])
        after_failure(error)
        raise
    try:
        deadline = started + participants.JOIN_GRACE_S
        joined, late = _collect_other_rng_states(writer, contents, others, deadline, record)
    except BaseException as error:
        writer.discard()
        after_failure(error)
        raise
    info = {
        "save_id": uuid.uuid4().hex,  # what random states added after the publish belong to (parts.py)
        "world_size": state.num_processes,
        "step": contents.step,
        "iteration": project.iteration if output_dir is None else None,
        "contents": {
            "models": len(contents.models) if saved_models is None else saved_models,
            "optimizers": len(contents.optimizers),
            "schedulers": len(contents.schedulers),
            "dataloaders": len(contents.dataloaders),
            "custom_objects": len(contents.custom_objects),
            "scaler": contents.scaler is not None,
        },
    }
    automatic = project.automatic_checkpoint_naming and output_dir is None

    def after_publish() -> None:
        if others:
            participants.announce_published(writer.final, contents.step, joined, late, record[1])
        if automatic and writer.is_main:
            rotate(project.project_dir, project.total_limit)

    if asynchronous:
        group = side_group(state.num_processes) if sharded else None
        limit = getattr(project, "async_staging_limit", None)
        start_background_save(
            writer, info, group, after_publish, [_torch_optimizer(o) for o in contents.optimizers], after_failure, limit
        )
    else:
        try:
            writer.finalize(info)
        except BaseException as error:
            after_failure(error)
            raise
        after_publish()


def _writer_rank(state: PartialState, on_each_node: bool) -> int:
    """The rank that writes this process's checkpoint folder (its machine's first with ``save_on_each_node``)."""
    return state.process_index - state.local_process_index if on_each_node else 0


def _asynchronous(contents: CheckpointContents, project, async_save: bool | None) -> bool:
    asynchronous = bool(getattr(project, "async_save", False) if async_save is None else async_save)
    if asynchronous and not contents.strategy.saves_full_state_dicts:
        warn_once(
            "async-save-engine",
            f"async_save: {type(contents.strategy).__name__} writes its sharded files itself, synchronously; this save "
            "and the next ones under this engine run synchronously (all-or-nothing as always).",
        )
        return False
    return asynchronous


def _live_memory(contents: CheckpointContents) -> frozenset[int]:
    """The memory of the parameters and the optimizer state, which only ``optimizer.step()`` changes: an
    asynchronous save stages it (or writes it, under ``async_staging_limit``) before the next step may run."""
    tensors = [p for model in contents.models for p in model.parameters()]
    tensors += [
        value
        for optimizer in contents.optimizers
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    ]
    return frozenset(t.data_ptr() for t in tensors)


def _torch_optimizer(optimizer):
    """The torch optimizer inside hasten's wrapper (its step hooks run on every real step)."""
    return getattr(optimizer, "optimizer", optimizer)


def _write_contents(writer: CheckpointWriter, contents: CheckpointContents, state: PartialState) -> int | None:
    """Hand everything to the writer; returns the number of models save hooks left (None: no hooks)."""
    saved_models = _run_save_hooks(writer, contents)
    contents.strategy.save_checkpoint(writer, contents.models if saved_models is None else [], contents.optimizers)
    if writer.is_main:
        _save_main_process_files(writer, contents)
    writer.save_state(f"random_states_{state.process_index}", _rng_states())
    return saved_models


def _rng_states() -> dict:
    meta, tensors = capture_rng_states()
    return {"meta": meta, "tensors": tensors}


def _count_iteration(project, output_dir) -> None:
    if project.automatic_checkpoint_naming and output_dir is None:
        project.iteration += 1


def _hand_over(
    writer: CheckpointWriter, contents: CheckpointContents, state: PartialState, asynchronous: bool, writer_rank: int
) -> str | None:
    """Replicated save on a process that writes nothing: run the hooks (in the writer's temporary folder,
    once it exists), give the writer this process's random states, and wait for the publish (in the
    background for an asynchronous save). A hook that raises fails the save on every process. A process that
    comes after the writer closed its door runs its hooks on the target folder and adds its random states to the
    published checkpoint itself (see ``parts.py``).

    Returns :data:`participants.ELSEWHERE` when the writer saves into another folder: nothing was handed
    over, and this process writes its own checkpoint."""
    rank = state.process_index
    arrived = bool(contents.save_hooks) and participants.arrive(writer.final, contents.step, rank, writer_rank)
    if arrived == participants.ELSEWHERE:
        return participants.ELSEWHERE
    if arrived:
        try:
            _run_save_hooks(writer, contents)
        except BaseException as error:
            message = _one_line(error, writer.final, f"a save hook on process {rank}")
            participants.report_failed(writer.final, contents.step, rank, message)
            raise CheckpointError(message) from error
    rng = _rng_states()
    wait_published = participants.hand_over(writer.final, contents.step, rank, writer_rank, rng, arrived)
    if wait_published == participants.ELSEWHERE:
        return participants.ELSEWHERE
    if contents.save_hooks and not arrived:
        _run_late_save_hooks(writer.final, contents, rank)

    def finish() -> None:
        if not wait_published():
            _add_late_states(writer.final, rank, rng)

    if asynchronous:
        start_waiting(writer.final, finish)
    else:
        finish()
    return None


def _run_late_save_hooks(final: Path, contents: CheckpointContents, rank: int) -> None:
    """The save hooks of a process that came after the writer closed its door, run on the target folder (the
    checkpoint is published, or about to be, without them)."""
    models = list(contents.models)
    try:
        for hook in contents.save_hooks:
            hook(models, [contents.strategy.get_state_dict(model) for model in models], str(final))
    except BaseException as error:
        raise CheckpointError(
            f"A save hook on process {rank} failed ({type(error).__name__}: {error}) for the checkpoint {final}, "
            "which the main process wrote without waiting for this process: it holds everything but this "
            "process's random number generator states."
        ) from error


def _add_late_states(final: Path, rank: int, rng: dict) -> None:
    """Add this process's random states to the checkpoint the writer published without them."""
    try:
        add_random_states(final, read_manifest(final)["save_id"], rank, rng)
    except (OSError, KeyError) as error:
        raise CheckpointError(
            f"The checkpoint {final} was saved, but process {rank} could not add its random number generator states "
            f"to it ({error}): loading it restores every state but those."
        ) from error


def _folder_peers(writer: CheckpointWriter, state: PartialState, on_each_node: bool) -> list[int]:
    """Replicated save, on the writer: the other processes whose random states belong in this folder."""
    per_node = max(state.launch.local_world_size, 1)
    return [
        r
        for r in range(state.num_processes)
        if r != state.process_index and (not on_each_node or r // per_node == writer.group)
    ]


def _one_line(error: BaseException, final: Path, where: str = "the main process") -> str:
    """The message every process raises for a save that failed on one of them."""
    if isinstance(error, CheckpointError):
        return str(error)
    return (
        f"Could not save the checkpoint {final}: {where} failed ({type(error).__name__}: {error}). Earlier "
        "checkpoints are untouched."
    )


def _collect_other_rng_states(
    writer: CheckpointWriter, contents: CheckpointContents, others: list[int], deadline: float, record
) -> tuple[list[int], list[int]]:
    """Replicated save: write the random states the other processes of this folder handed over (see
    :func:`participants.collect`); returns their ranks and those of the processes that had not come (they add
    their states after the publish)."""
    if not others:
        return [], []
    states, late = participants.collect(writer.final, contents.step, others, deadline, record)
    for rank, rng in sorted(states.items()):
        writer.save_state(f"random_states_{rank}", rng)
    return sorted(states), late


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
        raise ConfigError(
            "load_state() needs an input_dir, unless automatic checkpoint naming is on "
            "(ProjectConfiguration(project_dir=..., automatic_checkpoint_naming=True))."
        )
    latest = latest_checkpoint(project.project_dir)
    if latest is None:
        raise CheckpointError(f"No complete checkpoint in {Path(project.project_dir) / 'checkpoints'} to load.")
    return latest


def _check_counts(reader: CheckpointReader, contents: CheckpointContents, models: int) -> None:
    saved = reader.manifest.get("contents", {})
    now = {
        "models": models,
        "optimizers": len(contents.optimizers),
        "schedulers": len(contents.schedulers),
        "dataloaders": len(contents.dataloaders),
        "custom_objects": len(contents.custom_objects),
    }
    for kind, count in now.items():
        if saved.get(kind, count) != count:
            raise CheckpointError(
                f"Checkpoint {reader.directory} holds {saved[kind]} {kind} but this run prepared {count}: prepare (and "
                "register_for_checkpointing) the same objects, in the same order, as the run that saved it."
            )


def load_state(contents: CheckpointContents, project, input_dir=None) -> tuple[Path, int]:
    """Restore the training state from ``input_dir`` (or the latest automatic checkpoint); returns (path, step).

    Every file is verified (size and checksum) and every saved object checked against its live
    counterpart before any live object changes: a ``CheckpointError`` leaves the run as it was.
    """
    wait_for_pending_save()
    state = PartialState()
    source = _source(project, input_dir)
    finish_interrupted(Path(os.path.realpath(source)))  # a save into a shared folder that was cut short completes first
    reader = open_checkpoint(
        source, state.process_index, list(contents.models)
    )  # hasten's format, or a folder Accelerate wrote
    _load_verified(reader, contents, state, source)
    match = _NAME.match(source.name)
    if match and project.automatic_checkpoint_naming and input_dir is None:
        project.iteration = int(match.group(1)) + 1
    return source, int(reader.manifest.get("step") or 0)


def _load_verified(reader: CheckpointReader, contents: CheckpointContents, state: PartialState, source: Path) -> None:
    """Verify, check, then restore (nothing changes unless every file is whole and every object fits)."""
    _verify(reader, state)
    models = list(contents.models)
    for hook in contents.load_hooks:
        hook(models, str(source))
    _check_counts(reader, contents, len(models))
    staged = _read_small_states(reader, contents, state)
    contents.strategy.load_checkpoint(reader, models, contents.optimizers)
    for scheduler, saved in zip(contents.schedulers, staged["schedulers"]):
        scheduler.load_state_dict(saved)
    if contents.scaler is not None:
        contents.scaler.load_state_dict(staged["scaler"])
    for loader, position in zip(contents.dataloaders, staged["dataloaders"]):
        if contents.restore_dataloader_positions:
            loader.load_state_dict(position)
        else:  # as Accelerate: the loop skips what it trained on (diffusers' scripts, skip_first_batches)
            loader.restore_epoch(position)
    for obj, saved in zip(contents.custom_objects, staged["custom"]):
        obj.load_state_dict(saved)
    if staged["rng"] is not None:
        restore_rng_states(staged["rng"]["meta"], staged["rng"]["tensors"])


def _verify(reader: CheckpointReader, state: PartialState) -> None:
    """Check every file of the checkpoint; the processes of a machine share the work on the manifest's files and
    agree on the verdict (each checks all of its own folder when the processes load different folders, saved per
    process). The random states that processes added after the publish (``reader.parts``) are checked by each
    process itself: a process may see one that another did not see yet."""
    if state.num_processes == 1:
        reader.verify(sorted(reader.files))
        return
    reader.verify(sorted(reader.parts))
    names = sorted(set(reader.files) - set(reader.parts))
    local = max(state.launch.local_world_size, 1)
    found = reader.find_corrupt(names, share=(state.local_process_index, local))
    verdicts = gather_object([(str(Path(reader.directory).resolve()), found)])
    if len({folder for folder, _ in verdicts}) > 1:
        reader.verify(names)
        return
    bad = sorted({name for _, names_found in verdicts for name in names_found})
    if bad:
        raise CheckpointError(corrupt_message(reader.directory / bad[0]))
    reader.mark_verified(names)


def _read_small_states(reader: CheckpointReader, contents: CheckpointContents, state: PartialState) -> dict[str, Any]:
    """Read (not apply) schedulers, scaler, dataloader positions, custom objects and RNG states."""
    if contents.scaler is not None and not reader.exists("scaler.json"):
        raise CheckpointError(
            f"Checkpoint {reader.directory} has no fp16 scaler state, but this run uses fp16: it was saved with "
            "another mixed precision setting."
        )
    rng = random_state_for(reader, state.process_index, state.num_processes)
    if rng is None:
        warnings.warn(
            f"Checkpoint {reader.directory} was saved by {reader.manifest.get('world_size')} process(es) and has no "
            f"random state for rank {state.process_index} of this run's {state.num_processes}: this rank's random "
            "number generators are not restored, so dropout and shuffling may differ from the saved run.",
            stacklevel=5,
        )
    return {
        "schedulers": [reader.load_state(f"scheduler{_suffix(i)}") for i in range(len(contents.schedulers))],
        "scaler": reader.load_state("scaler") if contents.scaler is not None else None,
        "dataloaders": reader.load_json("dataloaders.json"),
        "custom": [reader.load_state(f"custom_checkpoint_{i}") for i in range(len(contents.custom_objects))],
        "rng": rng,
    }
