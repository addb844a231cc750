"""``load_state`` as a pipeline of three stages, each called once with what the previous one produced:
:func:`read` (the folder chosen, an interrupted publish finished, the checkpoint opened: hasten's format or a folder
Accelerate wrote) -> :func:`verify` (every file checked, the load hooks run, every saved object checked against its
live counterpart and the small states read) -> :func:`apply` (the live objects changed).

Nothing live changes before :func:`apply`: a ``CheckpointError`` raised before it leaves the run as it was.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError, ConfigError
from ..runtime.operations import gather_object
from ..runtime.rng import restore_rng_states
from .accelerate_format import open_checkpoint
from .contents import CheckpointContents, suffix
from .integrity import corrupt_message
from .naming import latest_checkpoint
from .publishing import finish_interrupted
from .world_change import random_state_for

if TYPE_CHECKING:
    from ..state import AcceleratorState


@dataclass(frozen=True)
class Loading:
    """One ``load_state`` on its way: the folder and its reader; after :func:`verify`, the models left to load and
    the small states read."""

    path: Path
    reader: Any  # a files.CheckpointReader, or an accelerate_format.AccelerateCheckpointReader
    models: list = field(default_factory=list)
    states: dict[str, Any] = field(default_factory=dict)

    @property
    def step(self) -> int:
        """The step the checkpoint was saved at."""
        return int(self.reader.manifest.get("step") or 0)


def read(contents: CheckpointContents, project, process: AcceleratorState, input_dir) -> Loading:
    """Open ``input_dir`` (or the latest automatic checkpoint) for this process (``process``: the state the
    ``Accelerator`` handed in); a save into a shared folder that was cut short completes first."""
    source = _source(project, input_dir)
    finish_interrupted(Path(os.path.realpath(source)))
    return Loading(source, open_checkpoint(source, process.process_index, list(contents.models)))


def verify(loading: Loading, contents: CheckpointContents, process: AcceleratorState) -> Loading:
    """Check every file, run the load hooks, check the saved objects against the live ones and read the small states
    (schedulers, scaler, dataloader positions, custom objects, random states); changes nothing live."""
    reader = loading.reader
    _verify_files(reader, process)
    models = list(contents.models)
    for hook in contents.load_hooks:
        hook(models, str(loading.path))
    _check_counts(reader, contents, len(models))
    return Loading(loading.path, reader, models, _read_small_states(reader, contents, process))


def apply(loading: Loading, contents: CheckpointContents) -> None:
    """Restore the live objects from a verified ``loading``."""
    contents.strategy.load_checkpoint(loading.reader, loading.models, contents.optimizers)
    states = loading.states
    for scheduler, saved in zip(contents.schedulers, states["schedulers"]):
        scheduler.load_state_dict(saved)
    if contents.scaler is not None:
        contents.scaler.load_state_dict(states["scaler"])
    for loader, position in zip(contents.dataloaders, states["dataloaders"]):
        if contents.restore_dataloader_positions:
            loader.load_state_dict(position)
        else:  # as Accelerate: the loop skips what it trained on (diffusers' scripts, skip_first_batches)
            loader.restore_epoch(position)
    for obj, saved in zip(contents.custom_objects, states["custom"]):
        obj.load_state_dict(saved)
    if states["rng"] is not None:
        restore_rng_states(states["rng"]["meta"], states["rng"]["tensors"])


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


def _verify_files(reader, process: AcceleratorState) -> None:
    """Check every file of the checkpoint; the processes of a machine share the work on the manifest's files and
    agree on the verdict (each checks all of its own folder when the processes load different folders, saved per
    process). The random states that processes added after the publish (``reader.parts``) are checked by each
    process itself: a process may see one that another did not see yet."""
    if process.num_processes == 1:
        reader.verify(sorted(reader.files))
        return
    reader.verify(sorted(reader.parts))
    names = sorted(set(reader.files) - set(reader.parts))
    local = max(process.launch.local_world_size, 1)
    found = reader.find_corrupt(names, share=(process.local_process_index, local))
    verdicts = gather_object([(str(Path(reader.directory).resolve()), found)])
    if len({folder for folder, _ in verdicts}) > 1:
        reader.verify(names)
        return
    bad = sorted({name for _, names_found in verdicts for name in names_found})
    if bad:
        raise CheckpointError(corrupt_message(reader.directory / bad[0]))
    reader.mark_verified(names)


def _check_counts(reader, contents: CheckpointContents, models: int) -> None:
    saved = reader.manifest.get("contents", {})
    for kind, count in contents.counts(models).items():
        if saved.get(kind, count) != count:
            raise CheckpointError(
                f"Checkpoint {reader.directory} holds {saved[kind]} {kind} but this run prepared {count}: prepare (and "
                "register_for_checkpointing) the same objects, in the same order, as the run that saved it."
            )


def _read_small_states(reader, contents: CheckpointContents, process: AcceleratorState) -> dict[str, Any]:
    """Read (not apply) schedulers, scaler, dataloader positions, custom objects and RNG states."""
    if contents.scaler is not None and not reader.exists("scaler.json"):
        raise CheckpointError(
            f"Checkpoint {reader.directory} has no fp16 scaler state, but this run uses fp16: it was saved with "
            "another mixed precision setting."
        )
    rng = random_state_for(reader, process.process_index, process.num_processes)
    if rng is None:
        warnings.warn(
            f"Checkpoint {reader.directory} was saved by {reader.manifest.get('world_size')} process(es) and has no "
            f"random state for rank {process.process_index} of this run's {process.num_processes}: this rank's random "
            "number generators are not restored, so dropout and shuffling may differ from the saved run.",
            stacklevel=5,
        )
    return {
        "schedulers": [reader.load_state(f"scheduler{suffix(i)}") for i in range(len(contents.schedulers))],
        "scaler": reader.load_state("scaler") if contents.scaler is not None else None,
        "dataloaders": reader.load_json("dataloaders.json"),
        "custom": [reader.load_state(f"custom_checkpoint_{i}") for i in range(len(contents.custom_objects))],
        "rng": rng,
    }
