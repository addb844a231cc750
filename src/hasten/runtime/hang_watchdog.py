"""Bounded hangs: a collective that does not complete within ``HASTEN_HANG_TIMEOUT`` ends the job with a report.

Active in every mode as soon as several processes run. The hot path costs one tuple assignment on
entry and one on exit of each collective of :mod:`hasten.runtime.operations` (no store round-trip, no extra
collective). One daemon thread per process does the rest:

- it publishes this rank's position (collective number, operation, waiting/done) to the rendezvous
  store at most once per period, and only when it changed;
- after ``min(30 s, timeout / 4)`` in one collective it prints one "still waiting" line with where
  the other ranks last were;
- after ``HASTEN_HANG_TIMEOUT`` seconds (default: the process group timeout given to
  ``InitProcessGroupKwargs``, else 300; ``0`` turns the watchdog off) it asks every
  rank for its stack through the store, prints the report (operation, collective number, where
  each rank last was, the stacks), writes it as ``hang_rank<N>.json`` into ``HASTEN_HANG_REPORT_DIR``
  (``hasten launch`` summarises those) and ends the process with exit code 1.

Collectives that hasten does not run itself (DDP's gradient all-reduce inside ``backward``) are
bounded by the process group's own timeout (``InitProcessGroupKwargs(timeout=...)``).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path

import torch.distributed as dist

from .. import environment

DEFAULT_HANG_TIMEOUT = 300.0
_KEY = "hasten_hang"

# (collective number, operation, monotonic start, thread id) while this process is inside a collective.
_current: tuple[int, str, float, int] | None = None
_seq = 0
_last: tuple[int, str] = (0, "")
_watchdog: _Watchdog | None = None


def enter(name: str) -> None:
    """Record that this process entered collective ``name`` (the hot path: no I/O)."""
    global _seq, _current, _last
    _seq += 1
    _last = (_seq, name)
    _current = (_seq, name, time.monotonic(), threading.get_ident())
    if _watchdog is None:
        _start()


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


def _start() -> None:
    global _watchdog
    timeout = hang_timeout()
    if timeout is None or timeout <= 0 or not (dist.is_available() and dist.is_initialized()):
        _watchdog = _Disabled()
        return
    _watchdog = _Watchdog(timeout)
    threading.Thread(target=_watchdog.run, name="hasten-hang-watchdog", daemon=True).start()


class _Disabled:
    """Stands in for the watchdog when it is turned off (``HASTEN_HANG_TIMEOUT=0``)."""


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # private API; without it the report only lacks the other ranks' positions
        return None


def _stack_of(thread_id: int | None) -> str:
    frame = sys._current_frames().get(thread_id or threading.main_thread().ident)
    return "".join(traceback.format_stack(frame)) if frame is not None else "(stack unavailable)"


class _Watchdog:
    """The per-process thread that publishes positions, answers stack requests and ends stuck ranks."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.store = _store()
        self.period = min(5.0, max(timeout / 20, 0.05))
        self.notice_after = min(30.0, timeout / 4)
        self._published: tuple | None = None
        self._noticed = 0
        self._answered = False

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

    def _publish(self, current) -> None:
        seq, op = _last
        status = "waiting" if current is not None and current[0] == seq else "done"
        position = (seq, op, status)
        if position != self._published:
            self._published = position
            self._store_call("set", f"{_KEY}/rank{self.rank}", json.dumps({"seq": seq, "op": op, "status": status}))

    def _answer_stack_request(self) -> None:
        if self._answered or not self._store_call("check", [f"{_KEY}/request"]):
            return
        self._answered = True
        stack = _stack_of(_current[3] if _current else None)
        self._store_call("set", f"{_KEY}/stack{self.rank}", stack)

    def peers(self) -> str:
        """Where every other rank last was, as published in the store (at most one period old)."""
        if self.store is None:
            return "(the rendezvous store is not reachable, so the other ranks' positions are unknown)"
        lines = []
        for rank in range(self.world):
            if rank == self.rank:
                continue
            key = f"{_KEY}/rank{rank}"
            raw = self._store_call("get", key) if self._store_call("check", [key]) else None
            info = json.loads(raw) if raw else None
            if info is None or not info["seq"]:
                lines.append(f"  - rank {rank}: has not entered any hasten collective")
            else:
                lines.append(f"  - rank {rank}: last entered collective #{info['seq']} `{info['op']}`, status: {info['status']}")
        return "\n".join(lines)

    def _notice(self, current, waited: float) -> None:
        seq, name = current[0], current[1]
        print(
            f"[hasten] rank {self.rank} has waited {waited:.0f} s in `hasten.runtime.operations.{name}` (collective #{seq}); "
            f"the job ends if it waits {self.timeout:g} s (HASTEN_HANG_TIMEOUT). Where the other ranks are:\n{self.peers()}",
            file=sys.stderr,
            flush=True,
        )

    def _peer_stacks(self) -> str:
        self._store_call("set", f"{_KEY}/request", str(self.rank))
        deadline = time.monotonic() + 2 * self.period + 1.0
        keys = [f"{_KEY}/stack{r}" for r in range(self.world) if r != self.rank]
        while time.monotonic() < deadline and not all(self._store_call("check", [k]) for k in keys):
            time.sleep(0.1)
        parts = []
        for rank, key in zip((r for r in range(self.world) if r != self.rank), keys):
            raw = self._store_call("get", key) if self._store_call("check", [key]) else None
            stack = raw.decode() if isinstance(raw, bytes) else "(no answer: the process is gone or its watchdog is blocked)"
            parts.append(f"Stack of rank {rank}:\n{stack}")
        return "\n".join(parts)

    def _end(self, current, waited: float) -> None:
        seq, name, _, thread_id = current
        self._publish(current)
        peers = self.peers()
        stack = _stack_of(thread_id)
        others = self._peer_stacks()
        message = (
            f"\n[hasten] rank {self.rank} has waited {waited:.1f} s (HASTEN_HANG_TIMEOUT={self.timeout:g}) in "
            f"`hasten.runtime.operations.{name}` (collective #{seq}).\nWhere the other ranks are:\n{peers}\n"
            f"A rank that never entered collective #{seq} skipped it or is stuck elsewhere; every rank must call the "
            f"same collectives in the same order. Raise HASTEN_HANG_TIMEOUT if a rank legitimately works alone this long.\n"
            f"Stack of rank {self.rank}:\n{stack}\n{others}"
        )
        print(message, file=sys.stderr, flush=True)
        report_dir = environment.get_str("HANG_REPORT_DIR")
        if report_dir:
            restart = environment.get_int_from_env(["TORCHELASTIC_RESTART_COUNT"], 0)
            record = {"rank": self.rank, "restart": restart, "operation": f"hasten.runtime.operations.{name}", "collective": seq, "waited_s": round(waited, 2), "stack": stack, "peers": peers}
            with contextlib.suppress(OSError):
                Path(report_dir, f"hang_rank{self.rank}.json").write_text(json.dumps(record, indent=1))
        os._exit(1)


def peers() -> str:
    """Where every other rank last was (for error messages); empty when the watchdog is not running."""
    return _watchdog.peers() if isinstance(_watchdog, _Watchdog) else "(unknown: the hang watchdog is off)"


def reset() -> None:
    """Forget the watchdog after the process group was replaced (the next collective starts a new one)."""
    global _watchdog
    _watchdog = None
