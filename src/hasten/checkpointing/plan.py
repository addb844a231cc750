"""The first stage of ``save_state``: the plan, settled before anything is written.

``save_state`` is a pipeline whose stages are each called once, with what the previous one produced:
:func:`plan_save` (this module: who takes part, the folder, its naming, the contents) -> on a process that writes
nothing, ``handing_over.hand_over`` (its random states given to the writer) -> ``stage.stage`` (every file handed to
the :class:`~.files.CheckpointWriter`, the other processes' random states collected) -> ``publisher.publish``
(written, manifest last, published, now or in the background; the other processes told; old checkpoints rotated).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, ConfigError
from ..state import AcceleratorState, warn_once
from . import participants
from .contents import CheckpointContents
from .naming import checkpoint_path
from .publishing import resolve_target


@dataclass(frozen=True)
class SavePlan:
    """What one ``save_state`` does on this process.

    ``publishes``: this process writes the shared files and publishes the folder (the main process, or each
    machine's local main process with ``save_on_each_node``); ``sharded``: every process writes its shards and
    meets the others in collectives; otherwise (a replicated engine) a process that does not publish hands its
    random states over (``hands_over``). ``peers``: on the publishing process of a replicated save, the processes
    whose random states belong in its folder.
    """

    contents: CheckpointContents
    project: Any
    target: Path  # the folder the checkpoint goes to (absolute)
    returned: Path  # what save_state returns: the path as given, or the automatic one
    automatic: bool  # the folder comes from automatic naming: the numbering moves on, old checkpoints rotate
    rank: int
    world: int
    publishes: bool
    sharded: bool
    writer_rank: int  # the process that publishes this process's folder
    group: int  # the key of the processes whose files end up in one folder (the machine with save_on_each_node)
    peers: tuple[int, ...]
    asynchronous: bool
    started: float  # time.monotonic() when save_state was called (the wait for the peers counts from it)

    @property
    def hands_over(self) -> bool:
        """This process writes nothing: it gives its random states to the process that publishes the folder."""
        return not (self.sharded or self.publishes)

    def on_its_own(self) -> SavePlan:
        """The plan of a process whose writer saves into another folder: it writes a complete checkpoint of its own
        into its folder (it holds the same replicated state), with nobody else's random states."""
        return replace(self, publishes=True, peers=())


def plan_save(
    contents: CheckpointContents,
    project,
    process: AcceleratorState,
    output_dir,
    safe_serialization: bool,
    async_save: bool | None,
) -> SavePlan:
    """The plan of this process's part in one save (``process``: the state the ``Accelerator`` handed in).

    Under a sharded engine it waits (boundedly) until every process called ``save_state`` with the same folder
    (:func:`participants.check_attendance`): nothing is written before.
    """
    if not safe_serialization:
        warn_once(
            "unsafe-serialization",
            "save_state(safe_serialization=False) is ignored: hasten checkpoints always store tensors in safetensors "
            "and structure in JSON (no pickle).",
        )
    asynchronous = _asynchronous(contents, project, async_save)
    on_each_node = project.save_on_each_node
    publishes = process.is_local_main_process if on_each_node else process.is_main_process
    sharded = contents.strategy.save_needs_every_process and process.num_processes > 1
    started = time.monotonic()
    named = _named_folder(project, output_dir, check_free=publishes or sharded)
    target = resolve_target(named)
    if sharded:
        participants.check_attendance(
            target, process.process_index, process.num_processes, type(contents.strategy).__name__
        )
    group = process.launch.node_rank if on_each_node else 0
    return SavePlan(
        contents=contents,
        project=project,
        target=target,
        returned=named if output_dir is None else Path(output_dir),
        automatic=output_dir is None,
        rank=process.process_index,
        world=process.num_processes,
        publishes=publishes,
        sharded=sharded,
        writer_rank=process.process_index - process.local_process_index if on_each_node else 0,
        group=group,
        peers=() if sharded or not publishes else _folder_peers(process, on_each_node, group),
        asynchronous=asynchronous,
        started=started,
    )


def _named_folder(project, output_dir, check_free: bool) -> Path:
    """The folder as named: ``output_dir``, or the next automatic checkpoint (refused when it exists already)."""
    if output_dir is not None:
        return Path(output_dir)
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


def _folder_peers(process: AcceleratorState, on_each_node: bool, group: int) -> tuple[int, ...]:
    """Replicated save, on the publishing process: the other processes whose random states belong in its folder."""
    per_node = max(process.launch.local_world_size, 1)
    return tuple(
        r
        for r in range(process.num_processes)
        if r != process.process_index and (not on_each_node or r // per_node == group)
    )
