"""Bounded hangs: a process waiting in any collective for ``HASTEN_HANG_TIMEOUT`` ends the job with a report.

Active in every mode as soon as several processes run: the process state starts it when it creates (or
finds) the process group, so that every process can answer for its stacks, also one that never enters a
collective. It sees every collective, not only hasten's: DDP's gradient all-reduce inside ``backward``, FSDP's
and DeepSpeed's collectives, torch's own ``dist.barrier``, through the count of collectives that torch keeps
per process group (see :mod:`hasten.runtime.hang_analysis`). The hot path costs nothing beyond what torch
counts anyway, plus one tuple assignment on entry and one on exit of each collective of
:mod:`hasten.runtime.operations`, which names hasten's operation in the report. One daemon thread per
process does the rest, once per period (``min(5 s, timeout / 20)``):

- it reads this process's counts and publishes its position (the counts, hasten's latest collective) to the
  rendezvous store when it changed; at exit the process publishes that it exited, and the uncaught error if any;
- it answers stack requests with the stacks of all its Python threads and names its child processes
  (DataLoader workers), with their stacks where they can give them (see :mod:`hasten.runtime.stack_dump`);
- once its counts have not moved for ``min(30 s, timeout / 4)``, it reads the other ranks' positions (one store
  round trip, again every such interval while nothing moves): a process that issued a collective that another
  member of the group has not issued waits in it, and it prints one "still waiting" line naming the ranks that
  did not arrive;
- after ``HASTEN_HANG_TIMEOUT`` seconds of waiting (default: the process group timeout given to
  ``InitProcessGroupKwargs``, else 300; ``0`` turns the watchdog off) it asks every rank for its stacks through
  the store, prints the report (see :mod:`hasten.runtime.hang_report`: the collective, which rank waits, which
  did not arrive and is the cause, the stacks), writes it as ``hang_rank<N>.json`` into
  ``HASTEN_HANG_REPORT_DIR`` (``hasten launch`` summarises it) and ends the process with exit code 1. Of several
  waiting processes, the first to reach the timeout reports; the others end once its report is out. A process
  on the same machine that does not answer (a thread holds the GIL in C code) is asked through faulthandler.

When a collective fails because a peer is gone, :func:`explain_failure` says where every other rank
stopped (a rank that left its loop early and exited is named with its last collective). The process group's
own timeout (hasten sets it to the hang timeout + 60 s when the user gave none) stays as a backstop.
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
from . import hang_analysis, hang_report, stack_dump

DEFAULT_HANG_TIMEOUT = 300.0
_KEY = "hasten_hang"

# (collective number, operation, monotonic start) while this process is inside a hasten collective.
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
    _watchdog.publish()
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


def _counters() -> dict[str, int] | None:
    """This process's collective counts per process group (None when they cannot be read: a group destroyed while
    read, at exit)."""
    try:
        return hang_analysis.counters()
    except Exception:  # private torch API; the thread must outlive any surprise there
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
        self._published: str | None = None
        self._counts: dict[str, int] = _counters() or {}
        self._since = time.monotonic()  # when this process last issued a collective (as far as seen)
        self._next_check = self._since + self.notice_after
        self._noticed: tuple | None = None
        self._answered: bytes | None = None

    def run(self) -> None:
        """The thread's loop; it ends once this watchdog was replaced."""
        while _watchdog is self:  # a replaced process group gets a new watchdog; this one then stops
            time.sleep(self.period)
            now = time.monotonic()
            counts = _counters()
            if counts is not None and counts != self._counts:
                self._counts, self._since, self._next_check = counts, now, now + self.notice_after
            self.publish()
            self._answer_stack_request()
            if now >= self._next_check:
                self._check(now)

    def _check(self, now: float) -> None:
        """This process issued no collective for a while: does it wait in one that another rank did not issue?"""
        waited, deadline = now - self._since, self._since + self.timeout
        self._next_check = min(now + self.notice_after, deadline) if now < deadline else now + self.notice_after
        positions = self.positions()
        wait = hang_analysis.find_wait(self.rank, positions) if self.store is not None else self._unpublished_wait()
        if wait is None:
            return
        if waited >= self.timeout:
            self._end(wait, waited, positions)
        elif self._noticed != (wait.group, wait.collective):
            self._noticed = (wait.group, wait.collective)
            self._notice(wait, waited)

    def _unpublished_wait(self) -> hang_analysis.Wait | None:
        """Without the store no count of the other ranks is known: a hasten collective still open is a wait."""
        if _current is None:
            return None
        group = hang_analysis.DEFAULT_GROUP
        return hang_analysis.Wait(group, self._counts.get(group, 0))

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

    def position(self, status: str | None = None) -> dict:
        """Where this process is: its latest hasten collective, and its count of collectives per process group."""
        seq, op = _last
        current = _current
        if status is None:
            status = "waiting" if current is not None and current[0] == seq else "done"
        return {"seq": seq, "op": op, "status": status, "groups": self._counts}

    def publish(self) -> None:
        """Publish this process's position to the store if it changed since the last time."""
        position = json.dumps(self.position())
        if position != self._published:
            self._published = position
            self._store_call("set", f"{_KEY}/rank{self.rank}", position)
        if self.identity["dump"] != stack_dump.dump_path():  # the script took SIGUSR2 for itself
            self.publish_identity()

    def record_exit(self) -> None:
        """Publish that this process exits, after which collective, and its uncaught error if any (at exit)."""
        error = getattr(sys, "last_value", None)
        self._counts = _counters() or self._counts
        record = self.position("exited")
        record["error"] = f"{type(error).__name__}: {_first_line(error)}"[:200] if error is not None else None
        self._store_call("set", f"{_KEY}/rank{self.rank}", json.dumps(record))

    def _answer_stack_request(self) -> None:
        request = self._store_call("get", f"{_KEY}/request") if self._store_call("check", [f"{_KEY}/request"]) else None
        if request is None or request == self._answered:
            return
        self._answered = request
        self._store_call("set", f"{_KEY}/stack{self.rank}", _own_stacks())

    def positions(self) -> dict[int, dict | None]:
        """Every rank's last published position (at most one period old; exits are published at once), this one's
        as it is now."""
        keys = [f"{_KEY}/rank{rank}" for rank in range(self.world)]
        if self._store_call("check", keys):  # every rank published: one round trip
            raw = self._store_call("multi_get", keys) or [None] * self.world
        else:
            raw = [self._store_call("get", key) if self._store_call("check", [key]) else None for key in keys]
        found = {rank: json.loads(value) if value else None for rank, value in enumerate(raw)}
        found[self.rank] = self.position()
        return found

    def peers(self) -> str:
        """Where every other rank last was, as published in the store."""
        if self.store is None:
            return "(the rendezvous store is not reachable, so the other ranks' positions are unknown)"
        return "\n".join(f"  - rank {r}: {_where(info)}" for r, info in self.positions().items() if r != self.rank)

    def settled_peers(self, seq: int, seconds: float = 2.0) -> str:
        """:meth:`peers`, once every other rank reached hasten collective ``seq`` or exited (waiting at most
        ``seconds``)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            others = [info for rank, info in self.positions().items() if rank != self.rank]
            if all(info and (info["status"] == "exited" or info["seq"] >= seq) for info in others):
                break
            time.sleep(0.1)
        return self.peers()

    def _notice(self, wait: hang_analysis.Wait, waited: float) -> None:
        behind = ", ".join(
            f"rank {rank} (at #{count})" if count is not None else f"rank {rank}" for rank, count in wait.behind.items()
        )
        inside = f", inside `hasten.runtime.operations.{_current[1]}`" if _current is not None else ""
        print(
            f"[hasten] rank {self.rank} has waited {waited:.0f} s in collective #{wait.collective} of "
            f"{hang_analysis.describe_group(wait.group)}{inside}; not arrived: {behind or 'unknown'}. The job ends "
            f"if it waits {self.timeout:g} s ({environment.variable_name('HANG_TIMEOUT')}).",
            file=sys.stderr,
            flush=True,
        )

    def _peer_stacks(self) -> dict[int, str]:
        """Every other rank's stacks, asked through the store (through faulthandler for one that does not answer)."""
        self._store_call("set", f"{_KEY}/request", f"{self.rank}:{time.time()}")
        deadline = time.monotonic() + 2 * self.period + 1.0
        others = [r for r in range(self.world) if r != self.rank]
        keys = {r: f"{_KEY}/stack{r}" for r in others}
        while time.monotonic() < deadline and not all(self._store_call("check", [k]) for k in keys.values()):
            time.sleep(0.1)
        stacks = {}
        for rank in others:
            raw = self._store_call("get", keys[rank]) if self._store_call("check", [keys[rank]]) else None
            stacks[rank] = raw.decode() if isinstance(raw, bytes) else self._unanswered(rank)
        return stacks

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

    def _end(self, wait: hang_analysis.Wait, waited: float, positions: dict[int, dict | None]) -> None:
        """Report the hang and end this process; of several waiting processes, the first to get here reports and
        the others end once its report is out, answering its stack request until then."""
        reporter = self._store_call("compare_set", f"{_KEY}/reporter", "", str(self.rank))
        if reporter is not None and reporter.decode() != str(self.rank):
            self._leave_the_report_to(int(reporter.decode()), wait, waited)
        operation = f"hasten.runtime.operations.{_current[1]}" if _current is not None else None
        stacks = {self.rank: _own_stacks(), **self._peer_stacks()}
        hang = hang_report.Hang(self.rank, wait, waited, self.timeout, operation, positions, stacks)
        text, record = hang_report.build(hang)
        print(text, file=sys.stderr, flush=True)
        report_dir = environment.get_str("HANG_REPORT_DIR")
        if report_dir:
            record["restart"] = environment.get_int_from_env(["TORCHELASTIC_RESTART_COUNT"], 0)
            with contextlib.suppress(OSError):
                Path(report_dir, f"hang_rank{self.rank}.json").write_text(json.dumps(record, indent=1))
        self._store_call("set", f"{_KEY}/reported", str(self.rank))
        os._exit(1)

    def _leave_the_report_to(self, reporter: int, wait: hang_analysis.Wait, waited: float) -> None:
        print(
            f"[hasten] rank {self.rank} has waited {waited:.1f} s ({environment.variable_name('HANG_TIMEOUT')}="
            f"{self.timeout:g}) in collective "
            f"#{wait.collective} of {hang_analysis.describe_group(wait.group)}; rank {reporter} reports the hang.",
            file=sys.stderr,
            flush=True,
        )
        deadline = time.monotonic() + 4 * self.period + 10.0
        while time.monotonic() < deadline and not self._store_call("check", [f"{_KEY}/reported"]):
            self._answer_stack_request()
            time.sleep(min(self.period, 0.5))
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
