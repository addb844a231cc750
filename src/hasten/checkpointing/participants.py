"""Which processes take part in one ``save_state``, found out without a collective.

Scripts call ``save_state`` in two ways: on every process (the documented way), or on the main
process alone (``if accelerator.is_main_process: accelerator.save_state(path)``, the pattern of
diffusers' training scripts). While the main process saves alone, the other processes are already in
the next step, inside the engine's collectives: any collective the save entered would pair with theirs
and hang or corrupt the run. So the save talks to the other processes only through the launch's
key-value store (the one the process group was set up with), which is no collective.

* **Replicated engines** (one process, DDP): the main process writes the whole checkpoint; every other
  process that calls ``save_state`` hands its random number generator states over through the store
  (a few kilobytes) and waits until the checkpoint is published. A process with save hooks first says it
  is there (:func:`arrive`) and waits until the writer created the temporary folder its hooks write into
  (:func:`announce_begun`); the writer then waits for its hooks however long they run, and a hook that
  raises fails the save on every process with one message. The main process waits for those
  states at most :data:`JOIN_GRACE_S` seconds counted from its own call (its writing time counts), then
  closes the door: a process that was not there (a main-only save) is reported once, and its random
  states are not in the checkpoint. The door is closed atomically (``compare_set``), so a late process
  learns it was left out instead of waiting for ever.
  Once a save ended with no other process at all (the script saves from the main process alone), the
  run is marked *solo* in the store and the next saves do not wait: they take the states already handed
  over and close the door at once, so repeated main-only saves cost no grace. A process that then calls
  ``save_state`` after all (it finds the door closed) clears the mark, and the next saves wait again.
* **Sharded engines** (FSDP, DeepSpeed): every process writes its shards, so every process must call
  ``save_state``. Each process registers, then waits at most :data:`ATTENDANCE_TIMEOUT_S` seconds for
  the others before any collective; a process that does not come is a clear :class:`CheckpointError`
  on the processes that did, instead of a hang.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import time
from typing import Any, Callable

from ..errors import CheckpointError
from .state_io import decode, encode

JOIN_GRACE_S = 10.0
ATTENDANCE_TIMEOUT_S = 60.0
_CLOSED = b"closed"
_FAILED = b"failed:"
_PENDING = b"pending"
_SOLO_KEY = "hasten/save/solo"
_POLL_S = 0.02


def _store():
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def _prefix(target, step: int) -> str:
    digest = hashlib.sha1(str(target).encode("utf-8")).hexdigest()[:16]
    return f"hasten/save/{digest}/{step}"


def _pack(obj: Any) -> bytes:
    from safetensors.torch import save

    tree, tensors = encode(obj, "random_states")
    header = json.dumps(tree).encode("utf-8")
    return len(header).to_bytes(8, "little") + header + save(tensors)


def _unpack(blob: bytes) -> Any:
    from safetensors.torch import load

    size = int.from_bytes(blob[:8], "little")
    return decode(json.loads(blob[8 : 8 + size]), load(blob[8 + size :]))


def announce_begun(target, step: int) -> None:
    """On the writer of a replicated save: the temporary folder exists, save hooks elsewhere may write into it."""
    _store().set(f"{_prefix(target, step)}/begun", "1")


def arrive(target, step: int, rank: int) -> bool:
    """On a non-writing process with save hooks, before it runs them: tell the writer to wait for this
    process, then wait until the temporary folder exists. False: the writer had already closed its door
    (the hooks must not run; the folder may be published or gone)."""
    store = _store()
    key = f"{_prefix(target, step)}/rng/{rank}"
    if store.compare_set(key, "", _PENDING) != _PENDING:
        store.delete_key(_SOLO_KEY)
        return False
    store.wait([f"{_prefix(target, step)}/begun"])  # the writer holds the door open for a pending process
    return True


def report_failed(target, step: int, rank: int, message: str) -> None:
    """On a non-writing process whose save hooks raised after :func:`arrive`: the writer fails the save;
    returns once it removed the temporary folder (so no process sees a half-written checkpoint after)."""
    store = _store()
    key = f"{_prefix(target, step)}/rng/{rank}"
    store.set(key, _FAILED + message.encode("utf-8"))
    store.wait([f"{key}/published"])
    store.delete_key(f"{key}/published")


def hand_over(target, step: int, rank: int, states: Any, arrived: bool = False) -> Callable[[], None] | None:
    """On a non-writing process of a replicated save: give ``states`` to the writer (``arrived``: after
    :func:`arrive` returned True).

    Returns a function that waits until the checkpoint is published, or None when the writer had
    already stopped waiting (the states are not in the checkpoint).
    """
    store = _store()
    key = f"{_prefix(target, step)}/rng/{rank}"
    blob = _pack(states)

    def wait_published() -> None:
        store.wait([f"{key}/published"])  # the store's own timeout bounds it (the writer is alive and writing)
        outcome = store.get(f"{key}/published")
        store.delete_key(f"{key}/published")
        if outcome.startswith(_FAILED):
            raise CheckpointError(outcome[len(_FAILED) :].decode("utf-8"))

    if store.compare_set(key, _PENDING if arrived else "", blob) == blob:
        return wait_published
    if arrived:  # the writer gave up on this process only because the save failed elsewhere
        wait_published()
    store.delete_key(_SOLO_KEY)  # this process does save: the writer waits for it again next time
    return None


def collect(target, step: int, ranks: list[int], deadline: float) -> tuple[dict[int, Any], list[int]]:
    """On the writing process: the states handed over by ``ranks`` until ``deadline`` (``time.monotonic()``).

    In a solo run (an earlier save got no other process) it does not wait for the deadline. A process
    that arrived before the door closed is waited for past the deadline (its save hooks are running);
    one whose hooks raised fails the save (:class:`CheckpointError`). Returns ``(states by rank, ranks that did not
    come)``; the door is closed for the latter.
    """
    store = _store()
    prefix = _prefix(target, step)
    pending = {rank: f"{prefix}/rng/{rank}" for rank in ranks}
    solo = store.check([_SOLO_KEY])
    while not solo and time.monotonic() < deadline and not all(store.check([key]) for key in pending.values()):
        time.sleep(_POLL_S)
    states, missing = {}, []
    store.set(_SOLO_KEY, "1")  # before any door closes, so a late process's clearing (after its door closed) wins
    try:
        for rank, key in pending.items():
            value = store.compare_set(key, "", _CLOSED)
            while value == _PENDING:
                time.sleep(_POLL_S)
                value = store.get(key)
            if value == _CLOSED:
                missing.append(rank)
                continue
            store.delete_key(key)
            if value.startswith(_FAILED):
                raise CheckpointError(value[len(_FAILED) :].decode("utf-8"))
            states[rank] = _unpack(value)
    finally:
        store.delete_key(f"{prefix}/begun")
    if states:
        store.delete_key(_SOLO_KEY)
    return states, missing


def solo_run() -> bool:
    """Whether this launch's saves are marked main-only: the writer then waits for no other process."""
    store = _store()
    return store is not None and store.check([_SOLO_KEY])


def announce_published(target, step: int, ranks) -> None:
    """Tell the processes whose states were collected that the checkpoint is published."""
    store = _store()
    for rank in ranks:
        store.set(f"{_prefix(target, step)}/rng/{rank}/published", "1")


def announce_failed(target, step: int, ranks, message: str) -> None:
    """Tell ``ranks`` (every other process of the folder) that the save failed: those waiting for the
    publish, or arriving later, raise :class:`CheckpointError` with ``message`` instead of waiting."""
    store = _store()
    if store is None:
        return
    store.delete_key(f"{_prefix(target, step)}/begun")
    for rank in ranks:
        key = f"{_prefix(target, step)}/rng/{rank}"
        store.delete_key(key)  # states handed over but not collected: nobody will read them
        store.set(f"{key}/published", _FAILED + message.encode("utf-8"))


def check_attendance(target, step: int, rank: int, world: int, what: str) -> None:
    """Before a sharded save: wait (boundedly) until every process called ``save_state`` for ``target``."""
    store = _store()
    if store is None or world == 1:
        return
    prefix = _prefix(target, step)
    store.set(f"{prefix}/here/{rank}", "1")
    keys = [f"{prefix}/here/{r}" for r in range(world)]
    try:
        store.wait(keys, datetime.timedelta(seconds=ATTENDANCE_TIMEOUT_S))
    except RuntimeError:
        absent = [r for r, key in enumerate(keys) if not store.check([key])]
        store.delete_key(f"{prefix}/here/{rank}")
        raise CheckpointError(
            f"save_state({str(target)!r}) was called by process(es) {[r for r in range(world) if r not in absent]} but "
            f"process(es) {absent} did not call it within {ATTENDANCE_TIMEOUT_S:.0f} s. Under {what} every process "
            "writes its own shards, so call save_state on every process: remove the `if accelerator.is_main_process:` "
            "around it (hasten writes shared files from the main process only)."
        ) from None


def leave(target, step: int, rank: int) -> None:
    """After a sharded save everyone finished: forget this process's registration."""
    store = _store()
    if store is not None:
        store.delete_key(f"{_prefix(target, step)}/here/{rank}")
