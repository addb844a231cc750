"""Asynchronous saves: the state is staged in ``save_state``, the files are written in the background.

``save_state`` copies what is small or may change at any time (buffers, RNG states, schedulers, custom
objects) at once, and registers the parameters and the optimizer state (which only ``optimizer.step()``
changes) and every GPU tensor for *staging*: copying into a host buffer kept between saves (pinned for GPU
tensors, whose copies are queued on the current stream at once; see ``staging.py``). The background thread
copies the CPU tensors first; each optimizer's next ``step()`` waits (a step pre-hook) only until that copy
is done, then training goes on while the thread writes, checksums, fsyncs and publishes from the buffer.
So between ``save_state`` and the next ``optimizer.step()``, change parameters only through the optimizer
(or wait first with :func:`wait_for_pending_save`). Under ``async_staging_limit`` the files that do not fit
the buffer are written from the live tensors before the step may go on.

The thread runs at the training process's own CPU priority, the one a synchronous save runs at. With a core
to spare (training on one thread per process) it takes nothing from the steps; where every core is busy it
gets a fair share beside them, so the write always finishes. A lower priority would stall it: in Linux's idle
class (``SCHED_IDLE``), as hasten ran it before, a 1.21 GB save beside 2 busy processes on 2 cores still had
73 s to go after the next 3 steps (a synchronous save: 3.1 s), and any niceness above the process's lets a
CPU-bound write there fall more than 1.5x behind a synchronous save (a niceness-1 thread weighs 820 against
1024 for each of the 3 threads beside it, the 2 busy ones and training's: it gets 1.58x less CPU than a
synchronous save, which runs instead of training, gets; at the same priority, 1.33x less).

One save at most is in flight per process. It is waited for (and its error, if any, raised) by the next
``save_state``, by ``load_state``, by ``Accelerator.end_training()`` and by :func:`wait_for_pending_save`;
``wait_for_everyone`` does not wait (it is called often, and the save must not stall training). At
interpreter exit Python joins the writer thread, so a script that ends without ``end_training`` still
publishes its last checkpoint; an error found then is printed.

With several processes the background threads meet in their own gloo process group (created once, by
the first asynchronous save, on every process), so their collectives never interleave with the
training loop's. A crash before the manifest is written leaves only a ``.partial`` folder behind: the
previous checkpoint is still the latest complete one.
"""

from __future__ import annotations

import atexit
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from ..errors import CheckpointError
from .staging import release_staging_memory

_pending: _PendingSave | None = None
_side_group: Any = None
_atexit_registered = False


class _StepGate:
    """Holds each optimizer's next ``step()`` until the background thread has written the live tensors."""

    def __init__(self, optimizers: list):
        self.written = threading.Event()
        self.handles = [optimizer.register_step_pre_hook(self._wait) for optimizer in optimizers]

    def _wait(self, *_) -> None:
        self.written.wait()

    def open(self) -> None:
        self.written.set()

    def remove(self) -> None:
        self.open()
        for handle in self.handles:
            handle.remove()


class _PendingSave:
    """One save in flight: ``work(gate)`` runs on a background thread; its error is kept for the next wait point."""

    def __init__(self, final: Path, work: Callable[[_StepGate], None], optimizers: list):
        self.final, self.work = Path(final), work
        self.gate = _StepGate(optimizers)
        self.error: BaseException | None = None
        self.finished: float | None = None  # time.perf_counter() when the work ended (bench_checkpoint.py reads it)
        self.thread = threading.Thread(target=self._run, name="hasten-async-save")

    def _run(self) -> None:
        try:
            self.work(self.gate)
        except BaseException as error:  # raised at the next wait point, never lost
            self.error = error
        finally:
            self.finished = time.perf_counter()
            self.gate.open()


def side_group(num_processes: int):
    """The process group of the background writers (None with one process); call on every process at once."""
    global _side_group
    if num_processes == 1:
        return None
    if _side_group is None:
        import torch.distributed as dist

        _side_group = dist.new_group(backend="gloo")
    return _side_group


def start(
    writer,
    info: dict[str, Any],
    group,
    after: Callable[[], None],
    optimizers: list,
    on_error: Callable[[BaseException], None],
    limit: int | None = None,
) -> None:
    """Stage ``writer``'s snapshot (``limit``: at most that many bytes), then write, fsync and publish it in the
    background and run ``after`` (rotation); on a failure run ``on_error(error)`` (the error is raised at the
    next wait point).

    ``optimizers`` (torch optimizers) do not step until the live tensors the writer kept are staged or written.
    """
    writer.stage(limit)

    def work(gate: _StepGate) -> None:
        try:
            writer.copy_staged()
            writer.write_live()
            gate.open()
            writer.write_pending()
            writer.finalize(info, group=group)
        except BaseException as error:
            on_error(error)
            raise
        after()

    _begin(_PendingSave(writer.final, work, optimizers))


def start_waiting(final: Path, wait: Callable[[], None]) -> None:
    """On a process that writes nothing itself (a replicated save): wait for the writer's publish in the
    background, so that :func:`wait_for_pending_save` means the same on every process."""
    _begin(_PendingSave(final, lambda _gate: wait(), []))


def _begin(pending: _PendingSave) -> None:
    global _pending, _atexit_registered
    wait_for_pending_save()
    if not _atexit_registered:
        atexit.register(_report_at_exit)
        _atexit_registered = True
    _pending = pending
    _pending.thread.start()


def wait_for_pending_save() -> Path | None:
    """Wait for this process's asynchronous save in flight, if any, and return its path.

    Raises:
        CheckpointError: the background save failed (its partial folder is removed; earlier checkpoints
            are untouched).
    """
    global _pending
    pending, _pending = _pending, None
    if pending is None:
        return None
    pending.thread.join()
    pending.gate.remove()
    if isinstance(pending.error, CheckpointError):
        raise CheckpointError(str(pending.error)) from None
    if pending.error is not None:
        raise CheckpointError(
            f"The asynchronous save of {pending.final} failed: {pending.error!r}. Earlier checkpoints are untouched."
        ) from pending.error
    return pending.final


def _report_at_exit() -> None:
    try:
        wait_for_pending_save()
    except CheckpointError as error:
        print(f"hasten: {error}", file=sys.stderr)


def end_background_saves() -> None:
    """Wait for the save in flight (raising its error), forget the writers' process group and free the staging
    memory (``end_training``)."""
    global _side_group
    try:
        wait_for_pending_save()
    finally:
        _side_group = None
        release_staging_memory()
