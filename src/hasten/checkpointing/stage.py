"""The stage of ``save_state`` on a process that writes (see ``plan.py`` for the whole pipeline): every file of this
process handed to the :class:`~.files.CheckpointWriter` (written at once; for an asynchronous save kept for
``staging.py``'s host buffer), then the random states of the other processes of its folder collected.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from . import participants
from .contents import CheckpointContents, rng_states, run_save_hooks, suffix
from .files import CheckpointWriter
from .plan import SavePlan


@dataclass(frozen=True)
class Staged:
    """A save whose files are all handed to its writer: what ``publisher.publish`` finishes."""

    plan: SavePlan
    writer: CheckpointWriter
    gathering: participants.Gathering  # the other processes of the folder, told when it is published or failed
    info: dict[str, Any]  # the manifest's description of the save


def stage(plan: SavePlan) -> Staged:
    """Begin the writer, hand it every file this process writes, then collect the random states the other processes
    of the folder handed over (waiting for them only when they took part in an earlier save, see
    ``participants.py``). On a failure the temporary folder is removed, the other processes are told, and the error
    is raised."""
    contents = plan.contents
    writer = CheckpointWriter(
        plan.target,
        is_main=plan.publishes,
        rank=plan.rank,
        group=plan.group,
        solo=not plan.sharded,
        snapshot=plan.asynchronous,
        live=contents.live_memory() if plan.asynchronous else frozenset(),
    )
    gathering = participants.Gathering(writer.final, contents.step, plan.rank, plan.peers)
    writer.begin()
    gathering.begun()
    try:
        saved_models = _write_contents(writer, contents, plan.rank)
    except BaseException as error:
        writer.discard()
        gathering.close()
        gathering.failed(error)
        raise
    try:
        states = gathering.collect(plan.started + participants.JOIN_GRACE_S)
        for rank, rng in sorted(states.items()):
            writer.save_state(f"random_states_{rank}", rng)
    except BaseException as error:
        writer.discard()
        gathering.failed(error)
        raise
    return Staged(plan, writer, gathering, _info(plan, saved_models))


def _write_contents(writer: CheckpointWriter, contents: CheckpointContents, rank: int) -> int | None:
    """Hand everything to the writer; returns the number of models save hooks left (None: no hooks)."""
    weights = run_save_hooks(contents, writer.directory)
    if weights is not None and writer.is_main:
        for i, state_dict in enumerate(weights):
            writer.save_tensors(f"model{suffix(i)}.safetensors", state_dict)
    contents.strategy.save_checkpoint(writer, contents.models if weights is None else [], contents.optimizers)
    if writer.is_main:
        for i, scheduler in enumerate(contents.schedulers):
            writer.save_state(f"scheduler{suffix(i)}", scheduler.state_dict())
        if contents.scaler is not None:
            writer.save_state("scaler", contents.scaler.state_dict())
        writer.save_json("dataloaders.json", [loader.state_dict() for loader in contents.dataloaders])
        for i, obj in enumerate(contents.custom_objects):
            writer.save_state(f"custom_checkpoint_{i}", obj.state_dict())
    writer.save_state(f"random_states_{rank}", rng_states())
    return None if weights is None else len(weights)


def _info(plan: SavePlan, saved_models: int | None) -> dict[str, Any]:
    """What the manifest says of the save besides its files."""
    contents = plan.contents
    return {
        "save_id": uuid.uuid4().hex,  # what random states added after the publish belong to (parts.py)
        "world_size": plan.world,
        "engine": contents.strategy.distributed_type.value,  # a resume under another engine says what changed
        "step": contents.step,
        "iteration": plan.project.iteration if plan.automatic else None,
        "contents": {
            **contents.counts(len(contents.models) if saved_models is None else saved_models),
            "scaler": contents.scaler is not None,
        },
    }
