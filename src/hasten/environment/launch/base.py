"""The interface of a launch environment: how one kind of launcher (torch elastic, MPI, Slurm, ...) tells a process
where it sits in the job, and :class:`LaunchInfo`, what hasten keeps of it.

A launch environment reads its launcher's variables (``RANK``, ``OMPI_COMM_WORLD_RANK``, ``SLURM_PROCID``, ...): they
are the launcher's, not hasten's settings, which :mod:`hasten.environment.variables` alone reads.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

from ...errors import DistributedSetupError

# The rendezvous port torch.distributed uses when a launcher names none.
DEFAULT_PORT = 29500


@dataclass(frozen=True)
class LaunchInfo:
    """Where this process sits in the job, as told by its launcher.

    ``source`` is the :attr:`LaunchEnvironment.name` of the launcher that started it: ``"torchrun"`` (torch elastic,
    ``hasten launch``), ``"mpi"``, ``"slurm"`` or ``"none"`` (a plain ``python script.py``).
    """

    source: str
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: str | None = None
    master_port: int | None = None
    node_rank: int = 0

    @property
    def num_nodes(self) -> int:
        """Number of machines, assuming the same number of processes on every machine."""
        return max(self.world_size // max(self.local_world_size, 1), 1)


def launcher_int(*names: str) -> int | None:
    """The first of the launcher variables ``names`` that is set, as an integer; None when none is set.

    Raises:
        DistributedSetupError: the variable is not an integer (it names the variable).
    """
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError:
                raise DistributedSetupError(f"Launcher variable {name}={value!r} is not an integer.") from None
    return None


def export_for_torch(info: LaunchInfo) -> None:
    """Write the torch.distributed variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``) that are not set yet, for a process started by a launcher that does not write
    them (MPI, Slurm): ``init_process_group(init_method="env://")`` and libraries such as DeepSpeed read them."""
    values = {
        "RANK": info.rank,
        "WORLD_SIZE": info.world_size,
        "LOCAL_RANK": info.local_rank,
        "LOCAL_WORLD_SIZE": info.local_world_size,
        "MASTER_ADDR": info.master_addr or "127.0.0.1",
        "MASTER_PORT": info.master_port or DEFAULT_PORT,
    }
    for key, value in values.items():
        os.environ.setdefault(key, str(value))


class LaunchEnvironment(ABC):
    """One kind of launcher, behind the questions hasten asks of every launcher.

    A subclass names itself (:attr:`name`, the :attr:`LaunchInfo.source` it gives), says whether it started this
    process (:meth:`detect`, from its variables alone) and answers for the world size, the ranks, the rendezvous
    address and port; :meth:`prepare_rendezvous` gets the process ready for torch's ``env://`` rendezvous. The order
    in which the environments are asked is :data:`hasten.environment.launch.DETECTION_ORDER`; an environment is
    built only once :meth:`detect` said yes, so its other methods may rely on its variables.
    """

    name: ClassVar[str]

    @classmethod
    @abstractmethod
    def detect(cls) -> bool:
        """Whether this launcher started this process."""

    @abstractmethod
    def world_size(self) -> int:
        """Number of processes in the job."""

    @abstractmethod
    def rank(self) -> int:
        """This process's rank in the job."""

    @abstractmethod
    def local_rank(self) -> int:
        """This process's rank on its machine."""

    def local_world_size(self) -> int:
        """Number of processes on this machine (default: the whole job)."""
        return self.world_size()

    def node_rank(self) -> int:
        """Index of this machine, assuming the same number of processes on every machine."""
        return self.rank() // max(self.local_world_size(), 1)

    def main_address(self) -> str | None:
        """Address of the rendezvous (the machine of rank 0): ``MASTER_ADDR``, else None."""
        return os.environ.get("MASTER_ADDR")

    def main_port(self) -> int | None:
        """Port of the rendezvous: ``MASTER_PORT``, else None."""
        return launcher_int("MASTER_PORT")

    @abstractmethod
    def prepare_rendezvous(self, info: LaunchInfo) -> None:
        """Get this process ready for ``init_process_group(init_method="env://")``; called with :meth:`info`'s
        result before the process group is created."""

    def info(self) -> LaunchInfo:
        """What hasten keeps of this launch."""
        return LaunchInfo(
            self.name,
            self.rank(),
            self.world_size(),
            self.local_rank(),
            self.local_world_size(),
            self.main_address(),
            self.main_port(),
            self.node_rank(),
        )
