"""The stage of ``save_state`` on a process that writes nothing (a replicated engine's other processes): its
random states handed to the process that publishes the folder (see ``plan.py`` for the whole pipeline and
``participants.py`` for how the processes meet without a collective)."""

from __future__ import annotations

from pathlib import Path

from ..errors import CheckpointError
from . import participants
from .background import start_waiting
from .contents import CheckpointContents, rng_states, run_save_hooks
from .manifest import read_manifest
from .parts import add_random_states
from .plan import SavePlan
from .publishing import staging_folder


def hand_over(plan: SavePlan) -> SavePlan | None:
    """Run the save hooks (in the writer's temporary folder, once it exists), give the writer this process's random
    states, and wait for the publish (in the background for an asynchronous save). A hook that raises fails the save
    on every process. A process that comes after the writer closed its door runs its hooks on the target folder and
    adds its random states to the published checkpoint itself (see ``parts.py``).

    Returns None once handed over, or, when the writer saves into another folder (nothing was handed over), the plan
    of a complete checkpoint of this process's own (:meth:`SavePlan.on_its_own`).
    """
    contents, rank, final = plan.contents, plan.rank, plan.target
    folder = staging_folder(final)  # where the writer's temporary folder is, as the writer finds it
    arrived = bool(contents.save_hooks) and participants.arrive(final, contents.step, rank, plan.writer_rank)
    if arrived == participants.ELSEWHERE:
        return plan.on_its_own()
    if arrived:
        try:
            run_save_hooks(contents, folder)
        except BaseException as error:
            message = participants.failure_line(error, final, f"a save hook on process {rank}")
            participants.report_failed(final, contents.step, rank, message)
            raise CheckpointError(message) from error
    rng = rng_states()
    wait_published = participants.hand_over(final, contents.step, rank, plan.writer_rank, rng, arrived)
    if wait_published == participants.ELSEWHERE:
        return plan.on_its_own()
    if contents.save_hooks and not arrived:
        _run_late_save_hooks(contents, final, rank)

    def finish() -> None:
        if not wait_published():
            _add_late_states(final, rank, rng)

    if plan.asynchronous:
        start_waiting(final, finish)
    else:
        finish()
    return None


def _add_late_states(final: Path, rank: int, rng: dict) -> None:
    """Add this process's random states to the checkpoint the writer published without them."""
    try:
        add_random_states(final, read_manifest(final)["save_id"], rank, rng)
    except (OSError, KeyError) as error:
        raise CheckpointError(
            f"The checkpoint {final} was saved, but process {rank} could not add its random number generator states "
            f"to it ({error}): loading it restores every state but those."
        ) from error


def _run_late_save_hooks(contents: CheckpointContents, final: Path, rank: int) -> None:
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
