"""torch's elastic agent with one rule added: a failure anywhere ends the job everywhere, within seconds.

torch's agent stops its own workers when one fails, but says nothing to the agents of the other
machines: their workers sit in a collective until its timeout, and an agent whose workers finished
waits up to 300 s at the exit barrier. Here the launcher whose worker failed writes a record (machine,
rank, exit cause) into the rendezvous store that every launcher shares; the others read it every
half second, while their workers run and while they wait at the exit barrier, stop their workers and
report that record. A machine whose launcher fails before it joins (a bad setting, a missing
script) writes the same record through :func:`report_failure_before_join`, so machine 0 does not
wait out the join timeout; under the static rendezvous machine 0 marks that it joined, and the others
wait for that mark or the record before exchanging ranks. Losing the store (it lives in machine 0's
launcher) also ends the job.
Each restart (``--max_restarts``) gives the new workers a fresh store for their process group.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from torch.distributed import DistError, PrefixStore, TCPStore
from torch.distributed.elastic.agent.server.api import RunResult, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo, RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry
from torch.distributed.elastic.rendezvous.api import RendezvousError
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from .. import environment
from ..settings.command import command_name
from . import hang_summary

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.5
ACK_SECONDS = 5.0
REPORT_CONNECT_SECONDS = 30.0
JOIN_MARK_SECONDS = 60.0
_WORKER_STORE_TIMEOUT = 300
_FAILURE = "hasten/failure"
_FAILURE_SEEN = "hasten/failure_seen"
_JOINED = "hasten/machine_0_joined"
_DONE = "hasten/done"
_DONE_SEEN = "hasten/done_seen"


class JobFailure(Exception):
    """The job failed on another machine (``record``: machine, host, ranks, cause), or this launcher lost the store."""

    def __init__(self, record: dict) -> None:
        super().__init__(record.get("cause"))
        self.record = record

    def describe(self) -> str:
        """What failed where: the machine, then one line per failed process and how it ended."""
        record = self.record
        machine = f"machine {record.get('machine', '?')}"
        if record.get("before_join"):
            return f"{machine} ({record.get('host', '?')}) failed before it joined the job: {record.get('cause')}"
        ranks = record.get("ranks") or {}
        lines = [f"the job failed on {machine} ({record.get('host', '?')}):"]
        lines += [f"  rank {rank}: {cause}" for rank, cause in ranks.items()] or [f"  {record.get('cause')}"]
        return "\n".join(lines + ([record["hang"]] if record.get("hang") else []))

    @property
    def exitcode(self) -> int:
        """The exit code every launcher returns: the first failed process's, or 1 (killed by a signal, store lost)."""
        code = int(self.record.get("exitcode") or 1)
        return code if code > 0 else 1


def _raw_store(store) -> Any:
    """The store without the rendezvous round's prefix: the same object on every machine."""
    return store.underlying_store if isinstance(store, PrefixStore) else store


def _read(store, key: str) -> dict | None:
    return json.loads(store.get(key)) if store.check([key]) else None


class _StoreNotMet(RendezvousError):
    """The machines did not meet in the static rendezvous's store (machine 0's store not reached, or not every
    machine joined it within the join timeout); nothing is to be read from it."""


class _CheckedRendezvous(RendezvousHandler):
    """Torch's rendezvous handler, plus a look for a failure record as soon as the machines have met.

    The look comes before the agents exchange their ranks through the store, which would wait for a
    machine that failed before joining (its launcher completed the meeting only to say so).
    """

    def __init__(self, handler: RendezvousHandler, machine_rank: int, announce: str | None) -> None:
        self._handler = handler
        self._machine_rank = machine_rank
        self._announce = announce

    def next_rendezvous(self) -> RendezvousInfo:
        if self._announce:
            print(self._announce, file=sys.stderr, flush=True)
            self._announce = None
        try:
            info = self._handler.next_rendezvous()
        except DistError as exc:  # the static rendezvous's store not reached, or not every machine in it in time
            raise _StoreNotMet(f"{type(exc).__name__}: {exc}") from None
        store = _raw_store(info.store)
        record = self._failure_record(store, info.rank)
        if record is not None and record.get("machine") != self._machine_rank:
            store.add(_FAILURE_SEEN, 1)
            raise JobFailure(record)
        return info

    def _failure_record(self, store, rank: int) -> dict | None:
        """The failure record, read once machine 0's side of the meeting is known.

        The static rendezvous's store is up as soon as machine 0's launcher starts it, and one that cannot start
        writes its record a moment later: machine 0 marks that it joined when it has no record, and the other
        machines wait for the mark or the record (up to :data:`JOIN_MARK_SECONDS`), lest they exchange ranks with
        a machine that never will. The dynamic rendezvous needs no mark: a machine that cannot start closes it.
        """
        if self._handler.get_backend() != "static":
            return _read(store, _FAILURE)
        if rank == 0:
            record = _read(store, _FAILURE)
            if record is None:
                store.set(_JOINED, "1")
            return record
        deadline = time.monotonic() + JOIN_MARK_SECONDS
        while not store.check([_FAILURE]) and not store.check([_JOINED]) and time.monotonic() < deadline:
            time.sleep(0.02)
        return _read(store, _FAILURE)

    def get_backend(self) -> str:
        return self._handler.get_backend()

    @property
    def use_agent_store(self) -> bool:
        return self._handler.use_agent_store

    def is_closed(self) -> bool:
        return self._handler.is_closed()

    def set_closed(self) -> None:
        self._handler.set_closed()

    def num_nodes_waiting(self) -> int:
        return self._handler.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self._handler.get_run_id()

    def shutdown(self) -> bool:
        return self._handler.shutdown()


class JobAgent(LocalElasticAgent):
    """:class:`LocalElasticAgent` that publishes its final failure and stops when another machine's is published."""

    def __init__(self, *, machine_rank: int, describe_exit, **kwargs) -> None:
        super().__init__(**kwargs)
        self.machine_rank = machine_rank
        self.remote_failure: JobFailure | None = None
        self._describe_exit = describe_exit
        self._next_poll = 0.0
        self._rounds = 0
        self._worker_store: TCPStore | None = None

    def _rendezvous(self, worker_group) -> None:
        super()._rendezvous(worker_group)
        self._rounds += 1
        if self._rounds > 1 and worker_group.spec.rdzv_handler.use_agent_store:
            worker_group.master_port = self._fresh_worker_store(worker_group)

    def _fresh_worker_store(self, worker_group) -> int:
        """A new store for the restarted workers' process group; returns its port.

        torch hands the workers of every attempt the same store, which still holds the keys of the
        previous attempt's process group: the new ranks could read the dead ranks' addresses and wait
        on them (gloo: connection refused, or a hang until the process group's timeout).
        """
        key = f"hasten/worker_store_port/{self._rounds}"
        if worker_group.group_rank == 0:
            timeout = datetime.timedelta(seconds=_WORKER_STORE_TIMEOUT)
            self._worker_store = TCPStore(worker_group.master_addr, 0, None, True, timeout, wait_for_workers=False)
            self._store.set(key, str(self._worker_store.port))
        return int(self._store.get(key))

    def _monitor_workers(self, worker_group) -> RunResult:
        result = super()._monitor_workers(worker_group)
        if result.state in (WorkerState.UNHEALTHY, WorkerState.FAILED):
            if self._remaining_restarts == 0:
                self._publish(result)
            return result
        alone = worker_group.group_world_size == 1
        if result.state == WorkerState.HEALTHY and not alone and time.monotonic() >= self._next_poll:
            self._next_poll = time.monotonic() + POLL_SECONDS
            self.remote_failure = self._remote_failure()
            if self.remote_failure is not None:
                self._remaining_restarts = 0  # another machine's failure is final: no restart
                return RunResult(state=WorkerState.FAILED)
        return result

    def _exit_barrier(self) -> None:
        store = _raw_store(self._store)
        world = self._worker_group.group_world_size
        deadline = time.monotonic() + self._exit_barrier_timeout
        try:
            count = store.add(_DONE, 1)
            while count < world and time.monotonic() < deadline:
                time.sleep(POLL_SECONDS)
                self.remote_failure = self._remote_failure()
                if self.remote_failure is not None:
                    return
                count = store.add(_DONE, 0)
        except SignalException:
            raise
        except Exception as exc:  # the store's host is gone before every machine said it was done
            self.remote_failure = _lost_store(exc)
            return
        if count < world:
            print(
                f"{command_name()} launch: {world - count} machine(s) still running "
                f"{self._exit_barrier_timeout:.0f} s after this machine's processes finished; not waiting longer.",
                file=sys.stderr,
                flush=True,
            )
        _wait_for_count(store, _DONE_SEEN, world)

    def _publish(self, result: RunResult) -> None:
        """Write this machine's failure for the others (the first one written wins) and give them a moment to read it.

        When another machine's record was written first, this launcher reports that one (``remote_failure``); when
        the store is gone, its host's launcher ended, which is reported as the cause (this machine's workers failed
        because their peers there vanished with it).
        """
        try:
            hang = hang_summary.load(_hang_folder())
            record = json.dumps(failure_record(self.machine_rank, result.failures, self._describe_exit, hang))
        except Exception as exc:
            logger.debug("could not describe the failure: %s", exc)
            return
        try:
            store = _raw_store(self._store)
            stored = store.compare_set(_FAILURE, "", record).decode()
            if json.loads(stored).get("machine") != self.machine_rank:
                # another machine failed first (often the cause: this machine's workers saw its peers vanish)
                store.add(_FAILURE_SEEN, 1)
                self.remote_failure = JobFailure(json.loads(stored))
                return
        except SignalException:
            raise
        except Exception as exc:
            self.remote_failure = _lost_store(exc)
            return
        _wait_for_count(store, _FAILURE_SEEN, self._worker_group.group_world_size - 1, add=0)

    def _remote_failure(self) -> JobFailure | None:
        try:
            store = _raw_store(self._store)
            record = _read(store, _FAILURE)
            if record is None or record.get("machine") == self.machine_rank:
                return None
            store.add(_FAILURE_SEEN, 1)
            return JobFailure(record)
        except SignalException:
            raise
        except Exception as exc:
            return _lost_store(exc)


def _hang_folder() -> Path | None:
    """The folder the workers of this machine write their hang reports into (``hasten launch`` sets it)."""
    folder = environment.get_str("HANG_REPORT_DIR")
    return Path(folder) if folder else None


def _wait_for_count(store, key: str, target: int, seconds: float = ACK_SECONDS, add: int = 1) -> None:
    """Add ``add`` to the counter ``key``, then wait (at most ``seconds``) until it reaches ``target``; a lost store
    ends the wait."""
    deadline = time.monotonic() + seconds
    try:
        count = store.add(key, add)
        while count < target and time.monotonic() < deadline:
            time.sleep(0.05)
            count = store.add(key, 0)
    except Exception as exc:
        logger.debug("store gone while waiting for %s: %s", key, exc)


def _lost_store(exc: Exception) -> JobFailure:
    return JobFailure(
        {
            "machine": 0,
            "host": "the rendezvous host",
            "cause": f"lost the connection to the rendezvous store ({type(exc).__name__}: {exc}); the launcher of "
            "machine rank 0 ended or its machine became unreachable",
        }
    )


def failure_record(machine_rank: int, failures: dict, describe_exit, hang: list | None = None) -> dict:
    """The record another machine prints: where, which ranks, how each ended (``describe_exit(code)``), and when a
    hang ended the job, each rank's part in it and the summary (``hang``: :func:`hang_summary.load`'s reports)."""
    ranks = {}
    for rank, f in sorted(failures.items()):
        part = hang_summary.role(hang or [], rank)
        ranks[str(rank)] = (
            f"{describe_exit(f.exitcode)}{'; ' + part if part else ''} (local rank {f.local_rank}, pid {f.pid})"
        )
    first = min(failures.values(), key=lambda f: f.timestamp, default=None)
    return {
        "machine": machine_rank,
        "host": socket.gethostname(),
        "ranks": ranks,
        "exitcode": first.exitcode if first is not None else 1,
        "cause": "its processes were stopped" if not ranks else next(iter(ranks.values())),
        "hang": hang_summary.summary_of(hang or []),
    }


def launch(config, entrypoint, args: list, machine_rank: int, describe_exit, announce: str | None = None) -> dict:
    """Run the workers of this machine as torch's ``elastic_launch(config, entrypoint)(*args)`` does.

    Returns the workers' return values; raises ``ChildFailedError`` when a worker of this machine
    failed, :class:`JobFailure` when another machine's did (or the store was lost).
    """
    params = RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **config.rdzv_configs,
    )
    master_addr, master_port = None, None
    if config.rdzv_backend == "static":
        master_addr, master_port = parse_rendezvous_endpoint(config.rdzv_endpoint, default_port=-1)
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle
    spec = WorkerSpec(
        role=config.role,
        local_world_size=config.nproc_per_node,
        entrypoint=entrypoint,
        args=tuple(args),
        rdzv_handler=_CheckedRendezvous(rdzv_registry.get_rendezvous_handler(params), machine_rank, announce),
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval,
        master_addr=master_addr,
        master_port=master_port,
        local_addr=config.local_addr,
    )
    agent = JobAgent(
        spec=spec,
        logs_specs=config.logs_specs,
        start_method=config.start_method,
        log_line_prefix_template=config.log_line_prefix_template,
        shutdown_timeout=config.shutdown_timeout,
        machine_rank=machine_rank,
        describe_exit=describe_exit,
    )
    close_rendezvous = True
    try:
        result = agent.run()
        if agent.remote_failure is not None:
            raise agent.remote_failure
        if result.is_failed():
            raise ChildFailedError(name=str(entrypoint), failures=result.failures)
        return result.return_values
    except _StoreNotMet:
        raise
    except RendezvousError:
        host, port = parse_rendezvous_endpoint(config.rdzv_endpoint, default_port=29400)
        found = read_failure(host, port) if config.max_nodes > 1 else None
        if found is not None:
            raise found from None
        raise
    except DistError as exc:  # another machine's store vanished mid-operation: its launcher ended
        if machine_rank == 0:
            raise
        raise _lost_store(exc) from None
    except SignalException:
        close_rendezvous = False  # as torch does: a signalled agent leaves the rendezvous open
        raise
    finally:
        if close_rendezvous:
            spec.rdzv_handler.shutdown()


def report_failure_before_join(
    backend: str, host: str, port: int, run_id: str, num_machines: int, machine_rank: int, cause: str
) -> bool:
    """Tell the launchers waiting for this machine to join that it will not, and why (``cause``).

    Machine 0 hosts the store for the others (with a closed rendezvous for the dynamic backend) and
    keeps it up until they read the record. Any other machine connects to machine 0's store (waiting up to
    :data:`REPORT_CONNECT_SECONDS` for it to be up), writes the record and lets machine 0's rendezvous end: the
    static one completes (this connection counts as the missing machine) and machine 0 then reads the record at
    once; the dynamic one is closed. Returns whether the record was written.
    """
    timeout = datetime.timedelta(seconds=REPORT_CONNECT_SECONDS)
    record = json.dumps(
        {"machine": machine_rank, "host": socket.gethostname(), "before_join": True, "cause": cause, "exitcode": 1}
    )
    try:
        if machine_rank == 0:
            store = TCPStore(host, port, num_machines, True, timeout, wait_for_workers=False, multi_tenant=True)
            store.set(_FAILURE, record)
            if backend != "static":  # a closed dynamic rendezvous makes the others stop joining and read the record
                params = RendezvousParameters(backend, f"{host}:{port}", run_id, num_machines, num_machines)
                create_handler(store, C10dRendezvousBackend(store, run_id), params).set_closed()
            _wait_for_count(store, _FAILURE_SEEN, num_machines - 1, REPORT_CONNECT_SECONDS, add=0)
            return True
        store = TCPStore(host, port, None, False, timeout, wait_for_workers=False)
        store.compare_set(_FAILURE, "", record)
        if backend == "static":  # written first, then counted as the missing machine: machine 0 reads it at once
            TCPStore(host, port, num_machines, False, timeout)
        else:
            params = RendezvousParameters(
                backend, f"{host}:{port}", run_id, num_machines, num_machines, is_host="false"
            )
            rdzv_registry.get_rendezvous_handler(params).set_closed()
        return True
    except Exception as exc:
        logger.debug("could not reach the rendezvous store at %s:%s: %s", host, port, exc)
        return False


def read_failure(host: str, port: int) -> JobFailure | None:
    """The failure record in the rendezvous store at ``host:port`` (None when there is none or no store)."""
    try:
        store = TCPStore(host, port, None, False, datetime.timedelta(seconds=5), wait_for_workers=False)
        record = _read(store, _FAILURE)
        if record is not None:
            store.add(_FAILURE_SEEN, 1)
    except Exception:
        return None
    return JobFailure(record) if record is not None else None
