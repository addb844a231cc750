"""``save_state`` / ``load_state``: the whole training state in one self-describing checkpoint folder.

Each is a one-way pipeline whose stages are called once, each with what the previous one produced:

* ``save_state``: plan (``plan.py``: who takes part, the folder, its naming, the contents) -> on a process that
  writes nothing, hand over (``handing_over.py``) -> stage (``stage.py``: every file handed to the writer) ->
  publish (``publisher.py``: written, manifest last, published, now or in the background).
* ``load_state``: read -> verify -> apply (``loading.py``).

What the folder holds is described in ``contents.py``. The ``Accelerator`` hands in the contents, its project
configuration and its state (``process``: rank, number of processes, the launch); nothing here looks the
process-wide state up.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from .background import wait_for_pending_save
from .contents import CheckpointContents
from .handing_over import hand_over
from .loading import apply, read, verify
from .naming import _NAME
from .plan import plan_save
from .publisher import publish
from .stage import stage

if TYPE_CHECKING:
    from ..state import AcceleratorState


def save_state(
    contents: CheckpointContents,
    project,
    process: AcceleratorState,
    output_dir=None,
    safe_serialization: bool = True,
    async_save: bool | None = None,
) -> Path:
    """Write the training state to ``output_dir`` (or the next automatic checkpoint) and return its path.

    Under a replicated engine (one process, DDP) it works whether every process calls it or the main
    process alone and enters no collective. The main process waits for the others (boundedly) only when they
    took part in an earlier save of this run, so a run that saves from the main process alone never waits; a
    process that comes after the main process closed its door adds its random states to the published
    checkpoint itself; a process given another folder than the main process's writes a complete checkpoint of
    its own there. Under a sharded engine every process must call it, with the same folder (see
    :mod:`.participants`). ``async_save`` (default: ``project.async_save``) copies the state and returns; the
    files are written, fsynced and published by a background thread (see ``background.py``). A folder that holds
    other files keeps them (see ``publishing.py``).
    """
    wait_for_pending_save()
    plan = plan_save(contents, project, process, output_dir, safe_serialization, async_save)
    writing = hand_over(plan) if plan.hands_over else plan
    if writing is not None:
        staged = stage(writing)
        publish(staged)
    if plan.automatic:
        project.iteration += 1
    return plan.returned


def load_state(contents: CheckpointContents, project, process: AcceleratorState, input_dir=None) -> tuple[Path, int]:
    """Restore the training state from ``input_dir`` (or the latest automatic checkpoint); returns (path, step).

    Every file is verified (size and checksum) and every saved object checked against its live
    counterpart before any live object changes: a ``CheckpointError`` leaves the run as it was.
    """
    wait_for_pending_save()
    loading = read(contents, project, process, input_dir)
    loading = verify(loading, contents, process)
    apply(loading, contents)
    match = _NAME.match(loading.path.name)
    if match and input_dir is None:
        project.iteration = int(match.group(1)) + 1  # automatic naming goes on after the checkpoint loaded
    return loading.path, loading.step
