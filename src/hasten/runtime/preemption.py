"""Preemption: on SIGTERM or SIGUSR1, every rank finishes its step, all save one checkpoint at the same step, and exit.

Schedulers (Slurm's ``--signal``, Kubernetes, spot instances) send SIGTERM or SIGUSR1 some seconds
before they take a machine. ``hasten launch`` forwards the signal to every worker. In a worker whose
``Accelerator`` has a project folder with automatic checkpoint naming:

1. The signal handler only sets a flag (no I/O, no collective inside a handler).
2. At the next optimizer step (a real one, not an accumulation micro-step) the rank that sees the
   flag first proposes "save after step n + 1" in the process group's store (``compare_set``: the
   first proposal wins, every later reader gets the same number), then waits until every rank has
   acknowledged it. Ranks that got no signal (another machine's, for instance) learn it from a
   background thread that looks for the proposal in the store twice a second and sets their flag.
   Why n + 1 is reachable by all: the gradient all-reduce of step n + 1 needs the proposer, and the
   proposer enters it only after every rank acknowledged, so no rank can finish step n + 1 without
   knowing the target, and no rank has finished it yet.
3. After the agreed step, the next batch the loader that fed it is asked for (mid-epoch, or the
   request after the epoch's last batch) is not drawn: instead every rank calls ``save_state()`` (one complete
   checkpoint) and the process exits with :data:`PREEMPTED_EXIT_CODE`. ``hasten launch`` reports it
   and exits with the same code.

Without such a project folder the signal ends the process as it would without hasten, after one
line that says how to enable this. The per-step cost when no signal came is one global counter
increment and one global flag read (``bench/bench_preemption.py``).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import threading
import weakref
from datetime import timedelta
from pathlib import Path

from .. import environment
from ..errors import HastenError

PREEMPTED_EXIT_CODE = 75
"""Exit code of a worker and of ``hasten launch`` after a preemption signal when the checkpoint was saved
(``EX_TEMPFAIL`` of ``sysexits.h``: a temporary failure, run the same command again to resume)."""

MARKER_FILE = "preempted.json"
HINT = (
    "hasten: {signal} received; the job stops without a checkpoint. To save one and resume after a preemption, "
    "give the Accelerator a project folder with automatic checkpoint naming: "
    "Accelerator(project_config=ProjectConfiguration(project_dir=..., automatic_checkpoint_naming=True))."
)
_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_POLL_SECONDS = 0.5
_ACK_TIMEOUT_SECONDS = 20.0

_requested = False
save_due = False
"""True once the agreed step is done: the next batch request of a prepared dataloader saves and exits."""
_steps = 0
_target: int | None = None
_signal_name = "SIGTERM"
_accelerator_ref = None
_feeder = None  # weak reference to the dataloader that fed the agreed step
_watcher: tuple[threading.Thread, threading.Event] | None = None


def _write_stderr(text: str) -> None:
    # os.write, not print: a handler may interrupt a print in progress, and buffered writers refuse re-entry.
    os.write(2, (text + "\n").encode())


def _accelerator():
    return _accelerator_ref() if _accelerator_ref is not None else None


def _qualifies(accelerator) -> bool:
    config = accelerator.project_configuration
    return bool(config.project_dir) and bool(config.automatic_checkpoint_naming)


def _on_signal(signum: int, frame) -> None:
    global _requested, _signal_name
    _signal_name = signal.Signals(signum).name
    accelerator = _accelerator()
    if accelerator is None:
        if environment.get_int_from_env(["RANK"], 0) == 0:
            _write_stderr(HINT.format(signal=_signal_name))
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    if not _requested:
        _write_stderr(
            f"hasten: rank {accelerator.process_index}: {_signal_name} received; finishing the step, then saving a "
            "checkpoint."
        )
    _requested = True


def install(accelerator) -> None:
    """Handle SIGTERM/SIGUSR1 for ``accelerator`` (called by ``Accelerator()``; the newest Accelerator wins).

    Handlers are installed only in the main thread and only over the default disposition, so a script's
    own handlers are kept. An Accelerator without a project folder and automatic naming gets the hint.
    """
    global _accelerator_ref
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in _SIGNALS:
        if signal.getsignal(sig) in (signal.SIG_DFL, _on_signal):
            signal.signal(sig, _on_signal)
    if not _qualifies(accelerator):
        _accelerator_ref = None
        return
    _accelerator_ref = weakref.ref(accelerator)
    if accelerator.num_processes > 1:
        _start_watcher(accelerator.process_index)


def _store():
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store() if dist.is_initialized() else None


def _key(name: str) -> str:
    return f"hasten/preemption/{environment.get_int_from_env(['TORCHELASTIC_RESTART_COUNT'], 0)}/{name}"


def _start_watcher(rank: int) -> None:
    global _watcher
    store = _store()
    if _watcher is not None or store is None:
        return
    stop = threading.Event()
    thread = threading.Thread(target=_watch, args=(store, rank, stop), name="hasten-preemption-watch", daemon=True)
    thread.start()
    _watcher = (thread, stop)
    atexit.register(_stop_watcher)  # registered after the process group's teardown, so it runs before it


def _watch(store, rank: int, stop: threading.Event) -> None:
    global _requested
    target = _key("target")
    while not stop.wait(_POLL_SECONDS):
        try:
            found = store.check([target])
        except Exception:  # the store went away with the launcher: nothing left to watch
            return
        if found:
            _requested = True
            store.set(_key(f"ack/{rank}"), "1")
            return


def _stop_watcher() -> None:
    global _watcher
    if _watcher is not None:
        thread, stop = _watcher
        stop.set()
        thread.join(timeout=2 * _POLL_SECONDS)
        _watcher = None


def after_optimizer_step() -> None:
    """Called by ``AcceleratedOptimizer.step`` after each real step: counts it, and agrees on the save step once
    signalled."""
    global _steps
    _steps += 1
    if _requested:
        if save_due:  # no prepared dataloader was asked for a batch since the agreed step: save here instead
            save_and_exit()
        _agree()


def _agree() -> None:
    global _target, save_due, _feeder
    accelerator = _accelerator()
    if accelerator is None:
        return
    if _target is None:
        _target = _propose(accelerator)
    if _steps > _target:
        raise HastenError(
            f"Preemption: rank {accelerator.process_index} is at optimizer step {_steps}, past the agreed save step "
            f"{_target}; the ranks do not step together (does every rank call optimizer.step() the same number of "
            "times?)."
        )
    save_due = _steps == _target
    if save_due:
        loader = accelerator.gradient_state.active_dataloader
        _feeder = weakref.ref(loader) if loader is not None else None


def _propose(accelerator) -> int:
    store = _store() if accelerator.num_processes > 1 else None
    if store is None:
        return _steps
    proposal = _steps + 1
    target = int(store.compare_set(_key("target"), "", str(proposal)))
    store.set(_key(f"ack/{accelerator.process_index}"), "1")
    if target == proposal:
        acks = [_key(f"ack/{rank}") for rank in range(accelerator.num_processes)]
        try:
            store.wait(acks, timedelta(seconds=_ACK_TIMEOUT_SECONDS))
        except Exception as exc:
            raise HastenError(
                f"Preemption: not every rank acknowledged the save step {target} within {_ACK_TIMEOUT_SECONDS:.0f} s "
                f"({exc}); a rank may have died. The job stops without a preemption checkpoint."
            ) from None
    return target


def batch_requested(loader) -> None:
    """Called by a prepared dataloader while :data:`save_due`, when it is asked for its next batch (mid-epoch,
    after the epoch's last batch, or at an epoch's start): saves and exits if ``loader`` fed the agreed step
    (an evaluation loader in between does not).

    After the epoch's last batch the loader's position is "that epoch, zero batches left", which a resumed
    loop ends at once, so the loop's epoch counter (not yet moved on there) and the loader agree.
    """
    feeder = _feeder() if _feeder is not None else None
    if feeder is None or feeder is loader:
        save_and_exit()


def save_and_exit() -> None:
    """Save the preemption checkpoint on every rank and end the process with :data:`PREEMPTED_EXIT_CODE`."""
    global save_due
    save_due = False
    accelerator = _accelerator()
    path = accelerator.save_state()
    if accelerator.is_main_process:
        _write_stderr(
            f"hasten: {_signal_name}: saved {path} after optimizer step {_steps}; run the same command to resume."
        )
        folder = environment.get_str("PREEMPTION_DIR")
        if folder:
            record = {
                "signal": _signal_name,
                "checkpoint": str(path),
                "step": _steps,
                "processes": accelerator.num_processes,
            }
            Path(folder, MARKER_FILE).write_text(json.dumps(record), encoding="utf-8")
    sys.stdout.flush()
    raise SystemExit(PREEMPTED_EXIT_CODE)
