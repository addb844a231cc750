"""Bounded hangs: a collective that does not complete within ``HASTEN_HANG_TIMEOUT`` ends the job with a report.

Active in every mode as soon as several processes run: the process state starts it when it creates (or
finds) the process group, so that every process can answer for its stacks, also one that never enters a
hasten collective. The hot path costs one tuple assignment on entry and one on exit of each collective of
:mod:`hasten.runtime.operations` (no store round-trip, no extra collective). One daemon thread per
process does the rest:

- it publishes this rank's position (collective number, operation, waiting/done) to the rendezvous
  store at most once per period, and only when it changed; at exit the process publishes that it
  exited, after which collective, and the uncaught error if any;
- it answers stack requests with the stacks of all its Python threads and names its child processes
  (DataLoader workers), with their stacks where they can give them (see :mod:`hasten.runtime.stack_dump`);
- after ``min(30 s, timeout / 4)`` in one collective it prints one "still waiting" line with where
  the other ranks last were;
- after ``HASTEN_HANG_TIMEOUT`` seconds (default: the process group timeout given to
  ``InitProcessGroupKwargs``, else 300; ``0`` turns the watchdog off) it asks every
  rank for its stacks through the store, prints the report (operation, collective number, where
  each rank last was, the stacks), writes it as ``hang_rank<N>.json`` into ``HASTEN_HANG_REPORT_DIR``
  (``hasten launch`` summarises those) and ends the process with exit code 1. A process on the same
  machine that does not answer (a thread holds the GIL in C code) is asked through faulthandler.

When a collective fails because a peer is gone, :func:`explain_failure` says where every other rank
stopped (a rank that left its loop early and exited is named with its last collective). Collectives
that hasten does not run itself (DDP's gradient all-reduce inside ``backward``) are bounded by the
process group's own timeout (``InitProcessGroupKwargs(timeout=...)``).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

import torch.distributed as dist

from .. import environment
from . import stack_dump

DEFAULT_HANG_TIMEOUT = 300.0
_KEY = "hasten_hang"

# (collective number, operation, monotonic start) while this process is inside a collective.
_current: tuple[int, str, float] | None = None
_seq = 0
_last: tuple[int, str] = (0, "")
_watchdog: _Watchdog | None = None


def enter(name: str) -> int:
    """Record that this process entered collective ``name`` (the hot path: no I/O); returns its number."""
    global _seq, _current, _last
    _seq += 1
    _last = (_seq, name)
    _current = (_seq, name, time.monotonic())
    if _watchdog is None:
        _start()
    return _seq


def leave() -> None:
    """Record that this process left its collective."""
    global _current
    _current = None


def sequence() -> int:
    """Number of the latest collective this process entered."""
    return _seq


_group_timeout: float | None = None  # the process group timeout the user gave, recorded by the state


def set_group_timeout(seconds: float | None) -> None:
    """Record the process group timeout the user gave (``InitProcessGroupKwargs(timeout=...)``; None: none)."""
    global _group_timeout
    _group_timeout = seconds


def hang_timeout() -> float:
    """Seconds before a stuck collective ends the job: ``HASTEN_HANG_TIMEOUT``, else the process group's
    timeout the user gave (``InitProcessGroupKwargs(timeout=...)``), else :data:`DEFAULT_HANG_TIMEOUT`."""
    explicit = environment.get_float("HANG_TIMEOUT")
    if explicit is not None:
        return explicit
    return _group_timeout or DEFAULT_HANG_TIMEOUT


def start() -> None:
    """Start the watchdog once the process group exists (the process state calls it), unless it runs already."""
    if _watchdog is None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        _start()


_exit_hook_registered = False


def _start() -> None:
    global _watchdog, _exit_hook_registered
    timeout = hang_timeout()
    if timeout is None or timeout <= 0 or not (dist.is_available() and dist.is_initialized()):
        _watchdog = _Disabled()
        return
    stack_dump.install()
    _watchdog = _Watchdog(timeout)
    _watchdog.publish_identity()  # from this thread: one that holds the GIL next would keep the watchdog's from running
    if not _exit_hook_registered:  # after the process state's teardown hook, so it runs before the group goes
        atexit.register(_record_exit)
        _exit_hook_registered = True
    threading.Thread(target=_watchdog.run, name="hasten-hang-watchdog", daemon=True).start()


def _record_exit() -> None:
    if isinstance(_watchdog, _Watchdog):
        _watchdog.record_exit()


class _Disabled:
    """Stands in for the watchdog when it is turned off (``HASTEN_HANG_TIMEOUT=0``)."""


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # private API; without it the report only lacks the other ranks' positions
        return None


def _own_stacks() -> str:
    """This process's threads, then its child processes."""
    children = stack_dump.describe_children(os.getpid(), stack_dump.dump_path())
    return stack_dump.own_threads() + (f"\n{children}" if children else "")


class _Watchdog:
    """The per-process thread that publishes positions, answers stack requests and ends stuck ranks."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.store = _store()
        self.period = min(5.0, max(timeout / 20, 0.05))
        self.notice_after = min(30.0, timeout / 4)
        self.identity = {"host": socket.gethostname(), "pid": os.getpid(), "dump": None}
        self._published: tuple | None = None
        self._noticed = 0
        self._answered: bytes | None = None

    def run(self) -> None:
        """The thread's loop; it ends once this watchdog was replaced."""
        while _watchdog is self:  # a replaced process group gets a new watchdog; this one then stops
            time.sleep(self.period)
            current = _current
            self._publish(current)
            self._answer_stack_request()
            if current is None:
                continue
            waited = time.monotonic() - current[2]
            if waited > self.timeout:
                self._end(current, waited)
            elif waited > self.notice_after and self._noticed != current[0]:
                self._noticed = current[0]
                self._notice(current, waited)

    def _store_call(self, method: str, *args):
        if self.store is None:
            return None
        with contextlib.suppress(Exception):  # the store goes away when the rank hosting it exits
            return getattr(self.store, method)(*args)
        return None

    def _read(self, key: str) -> dict | None:
        raw = self._store_call("get", key) if self._store_call("check", [key]) else None
        return json.loads(raw) if raw else None

    def publish_identity(self) -> None:
        """Publish where this process runs (machine, pid, faulthandler dump file) for a report made elsewhere."""
        self.identity["dump"] = stack_dump.dump_path()
        self._store_call("set", f"{_KEY}/proc{self.rank}", json.dumps(self.identity))

    def _publish(self, current) -> None:
        seq, op = _last
        status = "waiting" if current is not None and current[0] == seq else "done"
        position = (seq, op, status)
        if position != self._published:
            self._published = position
            self._store_call("set", f"{_KEY}/rank{self.rank}", json.dumps({"seq": seq, "op": op, "status": status}))
        if self.identity["dump"] != stack_dump.dump_path():  # the script took SIGUSR2 for itself
            self.publish_identity()

    def record_exit(self) -> None:
        """Publish that this process exits, after which collective, and its uncaught error if any (at exit)."""
        seq, op = _last
        error = getattr(sys, "last_value", None)
        cause = f"{type(error).__name__}: {_first_line(error)}"[:200] if error is not None else None
        record = {"seq": seq, "op": op, "status": "exited", "error": cause}
        self._store_call("set", f"{_KEY}/rank{self.rank}", json.dumps(record))

    def _answer_stack_request(self) -> None:
        request = self._store_call("get", f"{_KEY}/request") if self._store_call("check", [f"{_KEY}/request"]) else None
        if request is None or request == self._answered:
            return
        self._answered = request
        self._store_call("set", f"{_KEY}/stack{self.rank}", _own_stacks())

    def positions(self) -> dict[int, dict | None]:
        """Every other rank's last published position (at most one period old; exits are published at once)."""
        return {rank: self._read(f"{_KEY}/rank{rank}") for rank in range(self.world) if rank != self.rank}

    def peers(self) -> str:
        """Where every other rank last was, as published in the store."""
        if self.store is None:
            return "(the rendezvous store is not reachable, so the other ranks' positions are unknown)"
        return "\n".join(f"  - rank {rank}: {_where(info)}" for rank, info in self.positions().items())

    def settled_peers(self, seq: int, seconds: float = 2.0) -> str:
        """:meth:`peers`, once every other rank reached collective ``seq`` or exited (waiting at most ``seconds``)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if all(info and (info["status"] == "exited" or info["seq"] >= seq) for info in self.positions().values()):
                break
            time.sleep(0.1)
        return self.peers()

    def _notice(self, current, waited: float) -> None:
        seq, name = current[0], current[1]
        print(
            f"[hasten] rank {self.rank} has waited {waited:.0f} s in `hasten.runtime.operations.{name}` (collective "
            f"#{seq}); the job ends if it waits {self.timeout:g} s (HASTEN_HANG_TIMEOUT). Where the other ranks "
            f"are:\n{self.peers()}",
            file=sys.stderr,
            flush=True,
        )

    def _peer_stacks(self) -> str:
        self._store_call("set", f"{_KEY}/request", f"{self.rank}:{time.time()}")
        deadline = time.monotonic() + 2 * self.period + 1.0
        others = [r for r in range(self.world) if r != self.rank]
        keys = {r: f"{_KEY}/stack{r}" for r in others}
        while time.monotonic() < deadline and not all(self._store_call("check", [k]) for k in keys.values()):
            time.sleep(0.1)
        parts = []
        for rank in others:
            raw = self._store_call("get", keys[rank]) if self._store_call("check", [keys[rank]]) else None
            stack = raw.decode() if isinstance(raw, bytes) else self._unanswered(rank)
            parts.append(f"Stack of rank {rank}:\n{stack}")
        return "\n".join(parts)

    def _unanswered(self, rank: int) -> str:
        """The stacks of a rank whose watchdog did not answer: through faulthandler when it runs on this machine."""
        identity = self._read(f"{_KEY}/proc{rank}")
        if identity is None:
            return "(no answer: the process never published where it runs; it is gone or started no watchdog)"
        where = f"pid {identity['pid']} on {identity['host']}"
        if identity["host"] != self.identity["host"]:
            return (
                f"(no answer from {where}: it is gone, or a thread holds the GIL in C code; "
                f"`py-spy dump --pid {identity['pid']}` on that machine shows its stacks)"
            )
        dumped = stack_dump.dump_other(identity["pid"], identity["dump"])
        children = stack_dump.describe_children(identity["pid"], identity["dump"])
        children = f"\n{children}" if children else ""
        if dumped is None:
            return f"(no answer from {where}: it is gone, or it holds the GIL and took SIGUSR2 for itself){children}"
        note = f"(its watchdog did not answer, a thread holds the GIL: stacks written by faulthandler, {where})"
        return f"{note}\n{dumped}{children}"

    def _end(self, current, waited: float) -> None:
        seq, name = current[0], current[1]
        self._publish(current)
        peers = self.peers()
        stack = _own_stacks()
        others = self._peer_stacks()
        message = (
            f"\n[hasten] rank {self.rank} has waited {waited:.1f} s (HASTEN_HANG_TIMEOUT={self.timeout:g}) in "
            f"`hasten.runtime.operations.{name}` (collective #{seq}).\nWhere the other ranks are:\n{peers}\nA rank "
            f"that never entered collective #{seq} skipped it or is stuck elsewhere; every rank must call the same "
            "collectives in the same order. Raise HASTEN_HANG_TIMEOUT if a rank legitimately works alone this long.\n"
            f"Stack of rank {self.rank}:\n{stack}\n{others}"
        )
        print(message, file=sys.stderr, flush=True)
        report_dir = environment.get_str("HANG_REPORT_DIR")
        if report_dir:
            restart = environment.get_int_from_env(["TORCHELASTIC_RESTART_COUNT"], 0)
            record = {
                "rank": self.rank,
                "restart": restart,
                "operation": f"hasten.runtime.operations.{name}",
                "collective": seq,
                "waited_s": round(waited, 2),
                "stack": stack,
                "peers": peers,
                "peer_stacks": others,
            }
            with contextlib.suppress(OSError):
                Path(report_dir, f"hang_rank{self.rank}.json").write_text(json.dumps(record, indent=1))
        os._exit(1)


def _where(info: dict | None) -> str:
    """One rank's published position in words."""
    if info is None:
        return "has not entered any hasten collective"
    seq, op, status = info["seq"], info["op"], info["status"]
    if status == "exited":
        after = f"after collective #{seq} `{op}`" if seq else "before entering any hasten collective"
        return f"exited {after}" + (f", after an uncaught {info['error']}" if info.get("error") else "")
    if not seq:
        return "has not entered any hasten collective"
    return f"last entered collective #{seq} `{op}`, status: {status}"


def peers() -> str:
    """Where every other rank last was (for error messages); empty when the watchdog is not running."""
    return _watchdog.peers() if isinstance(_watchdog, _Watchdog) else "(unknown: the hang watchdog is off)"


def explain_failure(name: str, seq: int, error: BaseException) -> str:
    """The message of collective ``name`` (number ``seq``) that failed with ``error``: where the other ranks stopped."""
    where = _watchdog.settled_peers(seq) if isinstance(_watchdog, _Watchdog) else "(unknown: the hang watchdog is off)"
    return (
        f"`hasten.runtime.operations.{name}` (collective #{seq}) failed: {type(error).__name__}: {_first_line(error)}\n"
        f"Where the other ranks are:\n{where}\n"
        f"A rank that exited or stopped calling collectives before collective #{seq} leaves the others without a "
        "peer: every rank must call the same collectives in the same order (a loop that ends earlier on some ranks, "
        "a `break` or an error on one rank breaks that). The launcher's summary says how each process ended."
    )


def _first_line(error: BaseException) -> str:
    text = str(error)
    return text.splitlines()[0] if text else ""


def reset() -> None:
    """Forget the watchdog after the process group was replaced (the next collective starts a new one)."""
    global _watchdog
    _watchdog = None
