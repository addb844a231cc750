"""MPI (``mpirun``/``mpiexec`` of Open MPI, MPICH and Intel MPI, PMIx, MVAPICH2): ranks from the MPI library's
variables, the rendezvous from ``MASTER_ADDR``/``MASTER_PORT`` (on one machine: 127.0.0.1 and torch's default port)."""

from __future__ import annotations

from ...errors import DistributedSetupError
from .base import DEFAULT_PORT, LaunchEnvironment, LaunchInfo, export_for_torch, launcher_int

# Each quantity's variables, asked in this order: Open MPI, MPICH/Intel MPI (PMI), PMIx, MVAPICH2.
_RANK = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")
_SIZE = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MV2_COMM_WORLD_SIZE")
_LOCAL_RANK = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMIX_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_RANK")
_LOCAL_SIZE = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "PMIX_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE")


class MPIEnvironment(LaunchEnvironment):
    """A process started by an MPI launcher: it sets a rank and a size, torch.distributed's variables are written
    from them before the process group is created."""

    name = "mpi"

    @classmethod
    def detect(cls) -> bool:
        """A rank and a size of one of the MPI flavours are set."""
        return launcher_int(*_RANK) is not None and launcher_int(*_SIZE) is not None

    def world_size(self) -> int:
        """The MPI size."""
        return launcher_int(*_SIZE)

    def rank(self) -> int:
        """The MPI rank."""
        return launcher_int(*_RANK)

    def local_world_size(self) -> int:
        """The processes on this machine, else the whole job."""
        local_world = launcher_int(*_LOCAL_SIZE)
        return local_world if local_world is not None else self.world_size()

    def local_rank(self) -> int:
        """The rank on this machine, else the rank modulo the processes per machine."""
        local_rank = launcher_int(*_LOCAL_RANK)
        return local_rank if local_rank is not None else self.rank() % self.local_world_size()

    def main_address(self) -> str:
        """``MASTER_ADDR``; 127.0.0.1 when the whole job runs on this machine.

        Raises:
            DistributedSetupError: the job spans machines and ``MASTER_ADDR`` is not set.
        """
        address = super().main_address()
        if address is not None:
            return address
        world, local_world = self.world_size(), self.local_world_size()
        if local_world == world:
            return "127.0.0.1"
        raise DistributedSetupError(
            f"MPI launch across machines detected (world size {world}, {local_world} per machine) but MASTER_ADDR "
            "is not set. Export MASTER_ADDR=<address of rank 0's machine> (and MASTER_PORT) to every rank, "
            "e.g. mpirun -x MASTER_ADDR=10.0.0.1 -x MASTER_PORT=29500 ..."
        )

    def main_port(self) -> int:
        """``MASTER_PORT``, else torch's default port."""
        return super().main_port() or DEFAULT_PORT

    def prepare_rendezvous(self, info: LaunchInfo) -> None:
        """Write torch.distributed's variables from the MPI ones (:func:`export_for_torch`)."""
        export_for_torch(info)
