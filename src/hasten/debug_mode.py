"""Debug mode for collectives: fail fast with a clear message instead of hanging.

Enabled by ``HASTEN_DEBUG_MODE=1`` (also under plain torchrun), ``hasten launch --debug`` or
``debug: true`` in the launch config. Before each collective of :mod:`hasten.operations` every rank
exchanges the operation's name, its sequence number and its input shapes; a mismatch raises
:class:`~hasten.errors.DistributedOperationException` on every rank, listing each process's shapes.

Each rank also records the collective it is in under a key of the rendezvous store. A watchdog
thread notices when the rank has waited longer than ``HASTEN_HANG_TIMEOUT`` seconds (default 120),
prints the operation, where every other rank last was and this rank's Python stack, writes the same
as ``hang_rank<N>.json`` into ``HASTEN_HANG_REPORT_DIR`` (for ``hasten launch`` to summarise) and
ends the process with exit code 1, so a job fails in seconds instead of timing out after 30 minutes.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path

import torch.distributed as dist

from . import environment
from .errors import DistributedOperationException

DEFAULT_HANG_TIMEOUT = 120.0
_SHAPE_FREE = {"gather_object", "broadcast_object_list", "wait_for_everyone"}


def active() -> bool:
    """True when collectives should be checked: debug mode is on and several processes run."""
    shared = _partial_state_store()
    enabled = shared["debug"] if "debug" in shared else environment.get_flag("DEBUG_MODE")
    return enabled and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


@functools.cache
def _partial_state_store() -> dict:
    from .state import PartialState  # state imports operations, which imports this module

    return PartialState._shared_state


def _describe(name: str, args, kwargs):
    if name in _SHAPE_FREE or not args:
        return None
    from .operations import _leaves, get_shape

    data = args[0]
    if not any(True for _ in _leaves(data)):
        return None
    return get_shape(data)


class _Monitor:
    """Tracks the collective this rank is in and reports when it waits too long."""

    def __init__(self) -> None:
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.timeout = environment.get_float("HANG_TIMEOUT", DEFAULT_HANG_TIMEOUT)
        self.seq = 0
        self.current: tuple[int, str, float] | None = None
        self.store = _default_store()
        self._publish("started")
        thread = threading.Thread(target=self._watch, name="hasten-hang-watchdog", daemon=True)
        thread.start()

    def _publish(self, status: str) -> None:
        if self.store is None:
            return
        op = self.current[1] if self.current else ""
        with contextlib.suppress(Exception):
            self.store.set(f"hasten_debug/rank{self.rank}", json.dumps({"seq": self.seq, "op": op, "status": status}))

    def enter(self, name: str) -> int:
        self.seq += 1
        self.current = (self.seq, name, time.monotonic())
        self._publish("waiting")
        return self.seq

    def leave(self) -> None:
        self._publish("done")
        self.current = None

    def peers(self) -> str:
        """Where every other rank last was, as told by the store."""
        if self.store is None:
            return "(the rendezvous store is not reachable, so the other ranks' positions are unknown)"
        lines = []
        for rank in range(self.world):
            if rank == self.rank:
                continue
            key = f"hasten_debug/rank{rank}"
            try:
                info = json.loads(self.store.get(key)) if self.store.check([key]) else None
            except Exception:  # the store may be gone when the peer process died
                info = None
            if info is None:
                lines.append(f"  - rank {rank}: has not entered any hasten collective")
            else:
                where = f"collective #{info['seq']} `{info['op']}`" if info["op"] else f"collective #{info['seq']}"
                lines.append(f"  - rank {rank}: last entered {where}, status: {info['status']}")
        return "\n".join(lines)

    def _watch(self) -> None:
        period = min(1.0, max(self.timeout / 10, 0.05))
        while True:
            time.sleep(period)
            current = self.current
            if current is not None and time.monotonic() - current[2] > self.timeout:
                self._report(*current)
                os._exit(1)

    def _report(self, seq: int, name: str, started: float) -> None:
        waited = time.monotonic() - started
        frame = sys._current_frames().get(threading.main_thread().ident)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "(stack unavailable)"
        peers = self.peers()
        message = (
            f"\n[hasten debug] rank {self.rank} has waited {waited:.1f} s (HASTEN_HANG_TIMEOUT={self.timeout:g}) in "
            f"`hasten.operations.{name}` (collective #{seq}).\nWhere the other ranks are:\n{peers}\n"
            f"A rank that never entered collective #{seq} skipped it or is stuck elsewhere; every rank must call the "
            f"same collectives in the same order.\nStack of rank {self.rank}:\n{stack}"
        )
        print(message, file=sys.stderr, flush=True)
        report_dir = environment.get_str("HANG_REPORT_DIR")
        if report_dir:
            record = {"rank": self.rank, "operation": f"hasten.operations.{name}", "collective": seq, "waited_s": round(waited, 2), "stack": stack, "peers": peers}
            with contextlib.suppress(OSError):
                Path(report_dir, f"hang_rank{self.rank}.json").write_text(json.dumps(record, indent=1))


def _default_store():
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # private API; debug mode still checks shapes without it
        return None


_monitor: _Monitor | None = None


def monitor() -> _Monitor:
    """The process's hang monitor, created on first use."""
    global _monitor
    if _monitor is None or _monitor.world != dist.get_world_size():
        _monitor = _Monitor()
    return _monitor


@contextlib.contextmanager
def checked(name: str, function, args, kwargs):
    """Verify that every rank calls ``name`` with compatible inputs, then run the body under the hang monitor."""
    mon = monitor()
    seq = mon.enter(name)
    try:
        payload = (name, seq, _describe(name, args, kwargs))
        everyone: list = [None] * mon.world
        try:
            dist.all_gather_object(everyone, payload)
        except RuntimeError as error:
            raise DistributedOperationException(
                f"Operation `hasten.operations.{name}` (collective #{seq}) failed while the ranks compared their "
                f"inputs: {error}\nWhere the other ranks are:\n{mon.peers()}"
            ) from error
        _compare(name, everyone)
        yield
    finally:
        mon.leave()


def _compare(name: str, everyone: list) -> None:
    names = {entry[0] for entry in everyone}
    seqs = {entry[1] for entry in everyone}
    if len(names) > 1 or len(seqs) > 1:
        listing = "\n".join(f"  - Process {i}: `{e[0]}` (collective #{e[1]})" for i, e in enumerate(everyone))
        raise DistributedOperationException(
            "Cannot apply desired operation: the processes called different collectives. Every process must call "
            f"the same collectives in the same order.\n\nOperation: `hasten.operations.{name}`\nCalls:\n{listing}"
        )
    shapes = [entry[2] for entry in everyone]
    if name == "pad_across_processes":
        shapes = [_ranks_only(s) for s in shapes]
    if any(s != shapes[0] for s in shapes):
        listing = "\n".join(f"  - Process {i}: {_fmt(e[2])}" for i, e in enumerate(everyone))
        raise DistributedOperationException(
            "Cannot apply desired operation due to shape mismatches. All shapes across devices must be valid.\n\n"
            f"Operation: `hasten.operations.{name}`\nInput shapes:\n{listing}"
        )


def _ranks_only(shape_structure):
    from .operations import recursively_apply

    return recursively_apply(lambda s: len(s), shape_structure, test_type=lambda x: isinstance(x, list) and all(isinstance(i, int) for i in x))


def _fmt(structure) -> str:
    return str(structure) if structure is not None else "(no tensors)"
