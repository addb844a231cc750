"""Rank agreement for :func:`~hasten.runtime.memory.find_executable_batch_size` that survives an OOM inside a
collective.

When one rank runs out of memory, the others may already wait in a collective of the same attempt
(DDP's gradient all-reduce): an agreement *collective* would meet the wrong peer and fail. So the ranks
agree through the rendezvous store instead, a side channel that no pending collective blocks:

1. Each attempt gets a generation number (the same on every rank) and a watcher thread that polls the
   store (every 0.2 s, off the training thread) for that generation's decision.
2. A rank that runs out of memory publishes "oom" and waits up to :data:`GRACE_SECONDS` for every
   rank's outcome. If all arrive (every rank finished or ran out of memory too, nobody is stuck), the
   decision is "keep": the process group survives. Otherwise it is "abort": the first writer of the
   decision key wins (``compare_set``), so every rank reads the same decision.
3. On "abort" every rank aborts its process group: the OOM rank itself, the others from their watcher
   thread, so that a collective stuck waiting for the OOM rank returns with an error. NCCL:
   ``ncclCommAbort`` (``_abort_process_group``) on every rank ends the pending kernels. Gloo: its
   ``abort()`` does not wake a pending operation in PyTorch 2.13, and its connections close only when
   the last reference to the group dies (a DDP model in the failed attempt's frames keeps it alive),
   so hasten shuts down the group's own TCP connections, the ones :func:`create_default_group` recorded when it
   created the group (Linux; elsewhere the group's timeout bounds the wait). The stuck peer then
   sees "Connection closed by peer". Once every rank has written its outcome, each one builds a fresh
   default group over the same store under a new prefix.
4. Every rank then retries at the smaller batch size.

Objects that hold the aborted group (a model prepared outside the decorated function) cannot be used
afterwards: prepare them inside it, after ``accelerator.free_memory()``, as Accelerate's docs show.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import threading
import time
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

from ..errors import HastenError
from . import hang_watchdog

GRACE_SECONDS = 2.0
_POLL_SECONDS = 0.2
_UNWATCHED_WAIT = 1800.0  # PyTorch's default group timeout, when the hang watchdog is off
_generations = itertools.count(1)


class PeerFailedError(HastenError, RuntimeError):
    """Another rank failed with an error that is not an out-of-memory error during the same attempt."""


def distributed() -> bool:
    """True when several processes share a default process group (the agreement is then needed)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class Attempt:
    """One attempt of the decorated function on every rank: start it, run the function, then :meth:`finish`."""

    def __init__(self) -> None:
        from torch.distributed import distributed_c10d as c10d

        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.backend = dist.get_backend()
        self.store = c10d._get_default_store()
        self.generation = next(_generations)
        self.prefix = f"hasten_oom/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{self.generation}"
        self._lock = threading.Lock()
        self._aborted = False
        self.failed_ranks: list[int] = []
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="hasten-oom-watcher", daemon=True)
        self._watcher.start()

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def _watch(self) -> None:
        while not self._stop.wait(_POLL_SECONDS):
            try:
                if self.aborting():
                    self._abort()
                    return
            except Exception:  # the store is gone: the job is ending, nothing to unblock
                return

    def _abort(self) -> None:
        with self._lock:
            if self._aborted:
                return
            self._aborted = True
            _abort_default_group()

    def _decide(self, decision: str) -> str:
        return self.store.compare_set(self._key("decision"), "", decision).decode()

    def aborting(self) -> bool:
        """True when the ranks decided to abort this attempt (an error here is then its consequence)."""
        key = self._key("decision")
        return bool(self.store.check([key])) and self.store.get(key) == b"abort"

    def give_up(self) -> None:
        """Publish a failure that is not an OOM, so that the other ranks stop instead of waiting for this one."""
        self._stop.set()
        self.store.set(self._key(f"rank{self.rank}"), "error")

    def finish(self, outcome: str) -> str:
        """Publish this rank's ``outcome`` ("ok", "oom" or "error"); return the agreed one for every rank.

        The agreed outcome is "oom" when any rank ran out of memory (the group is rebuilt first if it was
        aborted), "error" when a rank failed otherwise, "ok" when every rank succeeded.
        """
        self.store.set(self._key(f"rank{self.rank}"), outcome)
        keys = [self._key(f"rank{r}") for r in range(self.world)]
        if outcome == "oom" and not _all_present(self.store, keys, GRACE_SECONDS):
            if self._decide("abort") == "abort":
                self._abort()
        self.store.wait(keys, timedelta(seconds=_outcome_timeout()))
        decision = self._decide("keep")
        self._stop.set()
        self._watcher.join()
        outcomes = [self.store.get(k).decode() for k in keys]
        if decision == "abort":
            self._abort()
            _rebuild_default_group(self.store, f"hasten_pg/{self.prefix}", self.backend, self.rank, self.world)
        if "oom" in outcomes:
            return "oom"
        if "error" in outcomes:
            self.failed_ranks = [r for r, o in enumerate(outcomes) if o == "error"]
            return "error"
        return "ok"


def _all_present(store, keys: list[str], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while True:
        if store.check(keys):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def _outcome_timeout() -> float:
    timeout = hang_watchdog.hang_timeout()
    return timeout if timeout > 0 else _UNWATCHED_WAIT


def _abort_default_group() -> None:
    """Abort this rank's default process group: pending collectives end with an error, the group is dropped."""
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized():
        return
    if dist.get_backend() == "gloo":
        _shut_down(_group["sockets"])
    c10d._abort_process_group()


def _socket_fds() -> dict[int, int]:
    """{socket inode: fd} of this process (empty where /proc is unavailable)."""
    found = {}
    with contextlib.suppress(OSError):
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/self/fd/{fd}")
                if link.startswith("socket:["):
                    found[int(link[8:-1])] = int(fd)
    return found


_group: dict = {"options": {}, "sockets": frozenset()}  # the default group's options and its own sockets' inodes


def create_default_group(create: Callable[[], None], options: dict) -> None:
    """Run ``create`` (which builds the default process group with ``options``) and record the sockets it
    opened, so that an abort can shut down exactly those, and the options, so that a rebuild reuses them."""
    before = set(_socket_fds())
    create()
    _group.update(options=dict(options), sockets=frozenset(set(_socket_fds()) - before))


def _shut_down(inodes: frozenset[int]) -> None:
    """Shut down the group's peer connections: not its listener, never the rendezvous store's (by its port)."""
    store_port = int(os.environ.get("MASTER_PORT", "-1"))
    for inode, fd in _socket_fds().items():
        if inode not in inodes:
            continue
        with contextlib.suppress(OSError), socket.socket(fileno=os.dup(fd)) as sock:
            if sock.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            ports = {sock.getsockname()[1], sock.getpeername()[1]}  # a listener has no peer: OSError, left alone
            if store_port not in ports:
                sock.shutdown(socket.SHUT_RDWR)


def _rebuild_default_group(store, prefix: str, backend: str, rank: int, world: int) -> None:
    """Create a fresh default process group over the same rendezvous store, under a new key prefix."""
    if dist.is_initialized():
        dist.destroy_process_group()
    options = _group["options"]
    fresh = dist.PrefixStore(prefix, store)
    create_default_group(
        lambda: dist.init_process_group(backend=backend, store=fresh, rank=rank, world_size=world, **options), options
    )
    hang_watchdog.reset()
