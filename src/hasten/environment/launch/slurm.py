"""Slurm (``srun``): ranks from the job step's variables, the rendezvous on the step's first node."""

from __future__ import annotations

import os
import re

from .base import LaunchEnvironment, LaunchInfo, export_for_torch, launcher_int


class SlurmEnvironment(LaunchEnvironment):
    """A task of an ``srun`` job step with several tasks.

    A batch script that runs ``python train.py`` once also sees ``SLURM_PROCID=0`` but must stay a single process:
    only a job step (``SLURM_STEP_ID`` set) of two tasks or more is a distributed launch.
    """

    name = "slurm"

    @classmethod
    def detect(cls) -> bool:
        """``SLURM_PROCID``, ``SLURM_NTASKS`` (at least 2) and ``SLURM_STEP_ID`` are set."""
        rank, world = launcher_int("SLURM_PROCID"), launcher_int("SLURM_NTASKS")
        return rank is not None and world is not None and world >= 2 and os.environ.get("SLURM_STEP_ID") is not None

    def world_size(self) -> int:
        """``SLURM_NTASKS``."""
        return launcher_int("SLURM_NTASKS")

    def rank(self) -> int:
        """``SLURM_PROCID``."""
        return launcher_int("SLURM_PROCID")

    def local_rank(self) -> int:
        """``SLURM_LOCALID``, else 0."""
        return launcher_int("SLURM_LOCALID") or 0

    def local_world_size(self) -> int:
        """The tasks of this node (``SLURM_STEP_TASKS_PER_NODE``), else the whole job."""
        return _tasks_on_this_node() or self.world_size()

    def main_address(self) -> str:
        """``MASTER_ADDR``, else the first node of the step (else of the job), else 127.0.0.1."""
        address = super().main_address()
        if address is not None:
            return address
        nodes = parse_slurm_nodelist(os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST", ""))
        return nodes[0] if nodes else "127.0.0.1"

    def main_port(self) -> int:
        """``MASTER_PORT``, else a port from the job id: the same on every node of the job, different between
        jobs."""
        port = super().main_port()
        if port is not None:
            return port
        return 20000 + (launcher_int("SLURM_JOB_ID") or 0) % 10000

    def prepare_rendezvous(self, info: LaunchInfo) -> None:
        """Write torch.distributed's variables from Slurm's (:func:`export_for_torch`)."""
        export_for_torch(info)


def _tasks_on_this_node() -> int | None:
    raw = os.environ.get("SLURM_STEP_TASKS_PER_NODE") or os.environ.get("SLURM_TASKS_PER_NODE")
    node_id = launcher_int("SLURM_NODEID") or 0
    if not raw:
        return None
    counts: list[int] = []
    for part in raw.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            return None
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts[node_id] if node_id < len(counts) else counts[-1]


def parse_slurm_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm node list such as ``"gpu[01-03,07],cpu5"`` into host names."""
    hosts: list[str] = []
    for match in re.finditer(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist):
        prefix, ranges = match.group(1), match.group(2)
        if not ranges:
            hosts.append(prefix)
            continue
        for item in ranges.split(","):
            if "-" in item:
                lo, hi = item.split("-", 1)
                hosts += [f"{prefix}{i:0{len(lo)}d}" for i in range(int(lo), int(hi) + 1)]
            else:
                hosts.append(f"{prefix}{item}")
    return hosts
