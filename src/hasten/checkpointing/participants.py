"""Which processes take part in one ``save_state``, found out without a collective.

Scripts call ``save_state`` in two ways: on every process (the documented way), or on the main
process alone (``if accelerator.is_main_process: accelerator.save_state(path)``, the pattern of
diffusers' training scripts). While the main process saves alone, the other processes are already in
the next step, inside the engine's collectives: any collective the save entered would pair with theirs
and hang or corrupt the run. So the save talks to the other processes only through the launch's
key-value store (the one the process group was set up with), which is no collective.

* **Replicated engines** (one process, DDP): the main process writes the whole checkpoint; nothing in the
  save needs the other processes. Every other process that calls ``save_state`` hands its random number
  generator states over through the store (a few kilobytes) and leaves a mark that the processes of this run
  save together. The writer waits for the others only when that mark is there (they took part in an earlier
  save of this run), at most :data:`JOIN_GRACE_S` seconds counted from its own call (its writing time counts);
  without it (the first save of a run, and every save of a run that saves from the main process alone) it
  does not wait at all. When its own files are written and the wait, if any, is over, it closes its door
  atomically (``compare_set``) on each process: the states handed over by then go into the checkpoint; a
  process that has not come yet (a main-only save, or a process a moment late) is told, once the checkpoint
  is published, that it came late, and then adds its states itself (see ``parts.py``). A save whose wait no
  other process came to removes the mark: a script that switches to saving from the main process alone pays
  the wait once. A process with save hooks first says it is there (:func:`arrive`) and waits until the
  writer created the temporary folder its hooks write into (:func:`announce_begun`); the writer then waits for
  its hooks however long they run, and a hook that raises fails the save on every process with one message.
* **Different folders** (replicated engines): a script may give each process its own folder
  (Accelerate's own data-loop test saves into a ``tempfile.TemporaryDirectory()`` per process). The
  writer keeps a record of its save in progress in the store (a sequence number, the step, the folder,
  whether it still takes states; :func:`open_record`). A process that finds the writer saving into another
  folder at the same step leaves a mark where its states would go (so the writer does not wait for it) and
  writes a complete checkpoint of its own into its folder (it holds the same replicated state): each
  folder then loads on the process that saved it, as in Accelerate. A record older than the last one a
  process acted on, or of another step, is ignored; a closed record of another folder that did not see
  this process is trusted only after :data:`JOIN_GRACE_S` (it may be a main-only save just before the
  writer's save into this process's folder); only the process that is not the writer waits that long.
* **Sharded engines** (FSDP, DeepSpeed): every process writes its shards, so every process must call
  ``save_state``. Each process registers, then waits at most :data:`ATTENDANCE_TIMEOUT_S` seconds for
  the others before any collective (the first wait that lasts more than :data:`SAY_WAITING_AFTER_S` says so,
  once); a process that does not come is a clear :class:`CheckpointError`
  on the processes that did, instead of a hang, and the processes agree that this save was given up, so
  that their next save together meets again (see :func:`check_attendance`). Processes that name different
  folders fail at once, on every process, naming each process's folder (each process's shards must meet
  in one folder).
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any, Callable

from ..errors import CheckpointError
from ..state import warn_once
from .state_io import decode, encode

JOIN_GRACE_S = 10.0
ATTENDANCE_TIMEOUT_S = 60.0
SAY_WAITING_AFTER_S = 2.0
_CLOSED = b"closed"
_FAILED = b"failed:"
_LATE = b"late:"
_PENDING = b"pending"
_ELSEWHERE_MARK = b"elsewhere"
_TOGETHER_KEY = "hasten/save/together"  # the other processes took part in a save of this run
_POLL_S = 0.02
ELSEWHERE = "elsewhere"  # the writer saves into another folder: this process writes its own checkpoint
_last_paired: dict[int, int] = {}  # writer rank -> the sequence number of its save this process last acted on


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


def _record_key(writer: int) -> str:
    return f"hasten/save/writer/{writer}"


def open_record(target, step: int, writer: int) -> int:
    """On the writer of a replicated save: record the save in progress; returns its sequence number."""
    store = _store()
    sequence = store.add(f"hasten/save/seq/{writer}", 1)
    _write_record(store, writer, {"seq": sequence, "step": step, "target": str(target), "open": True, "elsewhere": []})
    return sequence


def _write_record(store, writer: int, record: dict) -> None:
    store.set(_record_key(writer), json.dumps(record))


def close_record(target, step: int, writer: int, sequence: int, elsewhere: list[int]) -> None:
    """On the writer: its save takes no more states; ``elsewhere`` are the processes found saving elsewhere."""
    _write_record(
        _store(), writer, {"seq": sequence, "step": step, "target": str(target), "open": False, "elsewhere": elsewhere}
    )


def _writer_says(store, target, step: int, rank: int, writer: int, waited: float) -> str | None:
    """Whether the writer's save that this process's save at ``step`` pairs with goes to the same folder
    ("same"), to another one (:data:`ELSEWHERE`), or is not known yet (None).

    Records older than the last one this process acted on, or of another step, are not this save's. A closed
    record of another folder is trusted at once only if the writer saw this process; otherwise after
    :data:`JOIN_GRACE_S` (the writer may have saved alone just before its save into this process's folder).
    Found saving elsewhere, this process tells that save not to wait for it (a mark where its states would go).
    """
    if not store.check([_record_key(writer)]):
        return None
    record = json.loads(store.get(_record_key(writer)))
    if record["seq"] <= _last_paired.get(writer, 0) or record["step"] != step:
        return None
    same = record["target"] == str(target)
    if not (same or record["open"] or rank in record["elsewhere"] or waited > JOIN_GRACE_S):
        return None
    _last_paired[writer] = record["seq"]
    if same:
        return "same"
    store.compare_set(f"{_prefix(record['target'], step)}/rng/{rank}", "", _ELSEWHERE_MARK)
    return ELSEWHERE


def announce_begun(target, step: int) -> None:
    """On the writer of a replicated save: the temporary folder exists, save hooks elsewhere may write into it."""
    _store().set(f"{_prefix(target, step)}/begun", "1")


def arrive(target, step: int, rank: int, writer: int) -> bool | str:
    """On a non-writing process with save hooks, before it runs them: tell the writer to wait for this
    process, then wait until the temporary folder exists. False: the writer had already closed its door
    (the hooks must not run; the folder may be published or gone). :data:`ELSEWHERE`: the writer saves
    into another folder (this process writes its own checkpoint)."""
    store = _store()
    store.set(_TOGETHER_KEY, "1")
    key = f"{_prefix(target, step)}/rng/{rank}"
    if store.compare_set(key, "", _PENDING) != _PENDING:
        return False
    begun = f"{_prefix(target, step)}/begun"  # the writer holds the door open for a pending process
    if _wait_for(store, begun, target, step, rank, writer, until_same=False) == ELSEWHERE:
        store.delete_key(key)
        return ELSEWHERE
    return True


def _wait_for(store, key: str, target, step: int, rank: int, writer: int, until_same: bool) -> str:
    """Wait until ``key`` exists ("ready"), the writer is found saving elsewhere (:data:`ELSEWHERE`), or, with
    ``until_same``, saving into this folder ("same"). Bounded by the store's timeout."""
    started = time.monotonic()
    limit = store.timeout.total_seconds()
    while True:
        if store.check([key]):
            return "ready"
        waited = time.monotonic() - started
        says = _writer_says(store, target, step, rank, writer, waited)
        if says == ELSEWHERE or (until_same and says == "same"):
            return says
        if waited > limit:
            raise CheckpointError(
                f"save_state({str(target)!r}) on process {rank} waited {limit:.0f} s for process {writer} (which "
                "writes the checkpoint) to save at the same step, in vain: call save_state on every process at the "
                "same points, or on the main process alone."
            )
        time.sleep(_POLL_S)


def report_failed(target, step: int, rank: int, message: str) -> None:
    """On a non-writing process whose save hooks raised after :func:`arrive`: the writer fails the save;
    returns once it removed the temporary folder (so no process sees a half-written checkpoint after)."""
    store = _store()
    key = f"{_prefix(target, step)}/rng/{rank}"
    store.set(key, _FAILED + message.encode("utf-8"))
    store.wait([f"{key}/published"])
    store.delete_key(f"{key}/published")


def hand_over(
    target, step: int, rank: int, writer: int, states: Any, arrived: bool = False
) -> Callable[[], bool] | str:
    """On a non-writing process of a replicated save: give ``states`` to the writer (``arrived``: after
    :func:`arrive` returned True).

    Returns :data:`ELSEWHERE` when the writer saves into another folder (the states were taken back: this
    process writes its own checkpoint), else a function that waits until the checkpoint is published
    (:class:`CheckpointError` when the save failed) and returns True when the states are in it, False when the
    writer had closed its door before this process came (this process then adds them itself, see ``parts.py``).
    """
    store = _store()
    store.set(_TOGETHER_KEY, "1")
    key = f"{_prefix(target, step)}/rng/{rank}"
    blob = _pack(states)

    def wait_published() -> bool:
        store.wait([f"{key}/published"])  # the store's own timeout bounds it (the writer is alive and writing)
        outcome = store.get(f"{key}/published")
        store.delete_key(f"{key}/published")
        if outcome.startswith(_FAILED):
            raise CheckpointError(outcome[len(_FAILED) :].decode("utf-8"))
        late = outcome.startswith(_LATE)
        if late:
            store.delete_key(key)  # the door the writer closed: the next save at this step and folder starts afresh
        _last_paired[writer] = int(outcome[len(_LATE) :] if late else outcome)
        return not late

    if store.compare_set(key, _PENDING if arrived else "", blob) == blob:
        if arrived or _wait_for(store, f"{key}/published", target, step, rank, writer, until_same=True) != ELSEWHERE:
            return wait_published
        store.delete_key(key)  # the writer never reads this folder's keys
        return ELSEWHERE
    return wait_published  # the door was closed: the writer says when the checkpoint is published (or failed)


def collect(
    target, step: int, ranks: list[int], deadline: float, record: tuple[int, int]
) -> tuple[dict[int, Any], list[int]]:
    """On the writing process, once its own files are written: the states ``ranks`` handed over.

    When the other processes took part in an earlier save of this run it waits for them until ``deadline``
    (``time.monotonic()``); otherwise not at all. It then closes the door on every process that has not come (it
    adds its states after the publish). A process that saves into another folder leaves a mark instead of its
    states (see :func:`_writer_says`). A process that arrived before the door closed is waited for past the
    deadline (its save hooks are running); one whose hooks raised fails the save (:class:`CheckpointError`).
    ``record``: the writer's rank and :func:`open_record`'s number, closed here with the processes found saving
    elsewhere. Returns ``(states by rank, ranks that did not come)``.
    """
    store = _store()
    prefix = _prefix(target, step)
    pending = {rank: f"{prefix}/rng/{rank}" for rank in ranks}
    together = store.check([_TOGETHER_KEY])
    while together and time.monotonic() < deadline and not all(store.check([key]) for key in pending.values()):
        time.sleep(_POLL_S)
    states, missing, elsewhere = {}, [], []
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
            if value == _ELSEWHERE_MARK:
                elsewhere.append(rank)
                continue
            if value.startswith(_FAILED):
                raise CheckpointError(value[len(_FAILED) :].decode("utf-8"))
            states[rank] = _unpack(value)
    finally:
        store.delete_key(f"{prefix}/begun")
        close_record(target, step, record[0], record[1], elsewhere)
    if together and not states and not elsewhere:
        store.delete_key(_TOGETHER_KEY)  # nobody came to a save they were waited for: saves from the main process
    return states, missing


def saves_together() -> bool:
    """Whether the other processes of this launch took part in a save, so that the writer's next save waits for
    them (boundedly)."""
    store = _store()
    return store is not None and store.check([_TOGETHER_KEY])


def announce_published(target, step: int, joined, late, sequence: int) -> None:
    """Tell the processes whose states were collected (``joined``) and those the door was closed on (``late``) that
    the checkpoint is published (by the writer's save number ``sequence``, see :func:`open_record`)."""
    store = _store()
    for rank in joined:
        store.set(f"{_prefix(target, step)}/rng/{rank}/published", str(sequence))
    for rank in late:
        store.set(f"{_prefix(target, step)}/rng/{rank}/published", _LATE + str(sequence).encode("utf-8"))


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


def failure_line(error: BaseException, final, where: str = "the main process") -> str:
    """The message every process raises for a save that failed on one of them."""
    if isinstance(error, CheckpointError):
        return str(error)
    return (
        f"Could not save the checkpoint {final}: {where} failed ({type(error).__name__}: {error}). Earlier "
        "checkpoints are untouched."
    )


class Gathering:
    """On the publishing process of a replicated save: the other processes whose random states go into its folder
    (``peers``; none under a sharded engine or in a folder of one process's own), met through the store.

    Made before the writer begins (it records the save in progress, :func:`open_record`); then :meth:`begun` once
    the temporary folder exists, :meth:`collect` once this process's files are written, and :meth:`published` or
    :meth:`failed` at the end.
    """

    def __init__(self, target, step: int, rank: int, peers):
        self.target, self.step, self.rank, self.peers = target, step, rank, list(peers)
        self.sequence = open_record(target, step, rank) if self.peers else None
        self.joined: list[int] = []
        self.late: list[int] = []

    def begun(self) -> None:
        """The temporary folder exists: the peers' save hooks may write into it."""
        if self.peers:
            announce_begun(self.target, self.step)

    def collect(self, deadline: float) -> dict[int, Any]:
        """The random states the peers handed over (see :func:`collect`), by rank."""
        if not self.peers:
            return {}
        states, self.late = collect(self.target, self.step, self.peers, deadline, (self.rank, self.sequence))
        self.joined = sorted(states)
        return states

    def close(self) -> None:
        """This process failed before it collected: its record takes no more states."""
        if self.peers:
            close_record(self.target, self.step, self.rank, self.sequence, [])

    def failed(self, error: BaseException) -> None:
        """The save failed: every peer raises one line saying so instead of waiting."""
        if self.peers:
            announce_failed(self.target, self.step, self.peers, failure_line(error, self.target))

    def published(self) -> None:
        """The checkpoint is published: the peers waiting for it go on (the late ones add their states)."""
        if self.peers:
            announce_published(self.target, self.step, self.joined, self.late, self.sequence)


def check_attendance(target, rank: int, world: int, what: str) -> None:
    """Before a sharded save: wait (boundedly) until every process called ``save_state``; fail at once, on every
    process, when the processes name different folders.

    Every process of a sharded launch enters its sharded saves in the same order, so the n-th one of each meets
    under keys of its own (:func:`_here_key`), never deleted while another process may still read them: two saves
    into one folder at one step follow each other without a race. The processes agree on each meeting's outcome
    (``compare_set``): met, or given up by those that waited in vain (a main-only save); a process that comes to a
    meeting given up without it goes on to the next one, where the others will be at their next save.
    """
    store = _store()
    if store is None or world == 1:
        return
    global _sharded_saves
    while True:
        _sharded_saves += 1
        if _attend(store, _sharded_saves, target, rank, world, what):
            break
    for generation in _kept_keys[:-1]:  # every process reached this meeting: none reads an earlier one any more
        store.delete_key(_here_key(generation, rank))
        if rank == 0:
            store.delete_key(_outcome_key(generation))
    _kept_keys[:] = [_sharded_saves]


def _attend(store, generation: int, target, rank: int, world: int, what: str) -> bool:
    """Meet the other processes at their ``generation``-th sharded save: True once all came; False when the
    meeting was given up before this process came; :class:`CheckpointError` when this process gives it up."""
    _kept_keys.append(generation)
    store.set(_here_key(generation, rank), str(target))
    outcome = _outcome_key(generation)
    started = time.monotonic()
    deadline = started + ATTENDANCE_TIMEOUT_S
    while True:
        if store.check([outcome]) and store.get(outcome) == _GIVEN_UP:
            return False
        folders = {
            r: store.get(_here_key(generation, r)).decode("utf-8")
            for r in range(world)
            if store.check([_here_key(generation, r)])
        }
        if len(set(folders.values())) > 1:
            raise CheckpointError(_attendance_message(target, world, what, folders, []))
        if len(folders) == world:
            return store.compare_set(outcome, "", _MET) == _MET
        if time.monotonic() - started > SAY_WAITING_AFTER_S:
            absent = [r for r in range(world) if r not in folders]
            warn_once(
                "sharded-save-waits",
                f"save_state({str(target)!r}) on process {rank} waits for process(es) {absent} to call it too: under "
                f"{what} every process writes its own shards of the checkpoint (it gives up after "
                f"{ATTENDANCE_TIMEOUT_S:.0f} s). Call save_state on every process, not only on the main one.",
            )
        if time.monotonic() > deadline:
            if store.compare_set(outcome, "", _GIVEN_UP) == _MET:
                return True  # the last process came at the last moment
            absent = [r for r in range(world) if r not in folders]
            raise CheckpointError(_attendance_message(target, world, what, folders, absent))
        time.sleep(_POLL_S)


_sharded_saves = 0  # how many sharded-save meetings this process went to (every process of the launch counts alike)
_kept_keys: list[int] = []  # the meetings whose keys this process still keeps
_MET = b"met"
_GIVEN_UP = b"given up"


def _here_key(generation: int, rank: int) -> str:
    """Where process ``rank`` names its folder for the launch's ``generation``-th sharded-save meeting."""
    return f"hasten/save/sharded/{generation}/{rank}"


def _outcome_key(generation: int) -> str:
    return f"hasten/save/sharded/{generation}/outcome"


def _attendance_message(target, world: int, what: str, folders: dict[int, str], absent: list[int]) -> str:
    if len(set(folders.values())) > 1:
        named = "; ".join(f"process {rank}: {folder}" for rank, folder in sorted(folders.items()))
        return (
            f"save_state was given different folders on different processes ({named}). Under {what} every process "
            "writes its own shards of one checkpoint, so they must meet in one folder: give every process the same "
            "path (a shared filesystem). Nothing was written."
        )
    return (
        f"save_state({str(target)!r}) was called by process(es) {[r for r in range(world) if r not in absent]} but "
        f"process(es) {absent} did not call it within {ATTENDANCE_TIMEOUT_S:.0f} s. Under {what} every process "
        "writes its own shards, so call save_state on every process: remove the `if accelerator.is_main_process:` "
        "around it (hasten writes shared files from the main process only)."
    )
