"""Launch environments: one class per kind of launcher behind one interface (:class:`LaunchEnvironment`), asked in
the order of :data:`DETECTION_ORDER`. Adding a launcher is one module here and one entry in that list.

- :mod:`.torchelastic`: ``torchrun`` and ``hasten launch`` (torch's elastic agent),
- :mod:`.mpi`: ``mpirun``/``mpiexec`` (Open MPI, MPICH and Intel MPI, PMIx, MVAPICH2),
- :mod:`.slurm`: ``srun`` job steps,
- :mod:`.standalone`: no launcher, one process (always last: it is what remains).
"""

from __future__ import annotations

from .base import LaunchEnvironment, LaunchInfo, export_for_torch
from .mpi import MPIEnvironment
from .slurm import SlurmEnvironment, parse_slurm_nodelist
from .standalone import StandaloneEnvironment
from .torchelastic import TorchElasticEnvironment

# Asked in this order; the first that detects its launcher describes the process. Torch elastic comes first: a
# torchrun inside a Slurm allocation or under mpirun has written torch's own variables, which are the ones to follow.
DETECTION_ORDER: tuple[type[LaunchEnvironment], ...] = (
    TorchElasticEnvironment,
    MPIEnvironment,
    SlurmEnvironment,
    StandaloneEnvironment,
)


def detect_environment() -> LaunchEnvironment:
    """The launch environment of this process: the first of :data:`DETECTION_ORDER` that detects its launcher."""
    return next(kind for kind in DETECTION_ORDER if kind.detect())()


def detect_launch() -> LaunchInfo:
    """Find out how this process was launched: torchrun/elastic, MPI, Slurm, or not at all.

    Raises:
        DistributedSetupError: a launcher variable is not an integer, or an MPI job spans machines without
            ``MASTER_ADDR``.
    """
    return detect_environment().info()


def prepare_rendezvous(info: LaunchInfo) -> None:
    """Get this process ready for torch's ``env://`` rendezvous as the launcher that started it needs (MPI and Slurm:
    torch.distributed's variables written; torchrun: ``MASTER_ADDR`` checked)."""
    next(kind for kind in DETECTION_ORDER if kind.name == info.source)().prepare_rendezvous(info)


__all__ = [
    "DETECTION_ORDER",
    "LaunchEnvironment",
    "LaunchInfo",
    "MPIEnvironment",
    "SlurmEnvironment",
    "StandaloneEnvironment",
    "TorchElasticEnvironment",
    "detect_environment",
    "detect_launch",
    "export_for_torch",
    "parse_slurm_nodelist",
    "prepare_rendezvous",
]
