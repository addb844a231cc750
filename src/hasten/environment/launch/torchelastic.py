"""Torch elastic (``torchrun``, ``hasten launch``): the processes get torch.distributed's own variables."""

from __future__ import annotations

from ...errors import DistributedSetupError
from .base import LaunchEnvironment, LaunchInfo, launcher_int


class TorchElasticEnvironment(LaunchEnvironment):
    """A process started by torch's elastic agent (``torchrun``, ``hasten launch``) or given ``RANK``/``LOCAL_RANK``
    by hand: the rank is ``RANK`` (else ``LOCAL_RANK``), the world ``WORLD_SIZE`` (else 1)."""

    name = "torchrun"

    @classmethod
    def detect(cls) -> bool:
        """``RANK`` or ``LOCAL_RANK`` is set."""
        return launcher_int("RANK") is not None or launcher_int("LOCAL_RANK") is not None

    def world_size(self) -> int:
        """``WORLD_SIZE``, else 1."""
        world = launcher_int("WORLD_SIZE")
        return world if world is not None else 1

    def rank(self) -> int:
        """``RANK``, else ``LOCAL_RANK``."""
        rank = launcher_int("RANK")
        return rank if rank is not None else launcher_int("LOCAL_RANK")

    def local_rank(self) -> int:
        """``LOCAL_RANK``, else the rank."""
        local_rank = launcher_int("LOCAL_RANK")
        return local_rank if local_rank is not None else self.rank()

    def local_world_size(self) -> int:
        """``LOCAL_WORLD_SIZE``, else the world size."""
        return launcher_int("LOCAL_WORLD_SIZE") or self.world_size()

    def prepare_rendezvous(self, info: LaunchInfo) -> None:
        """The launcher wrote the rendezvous variables; a process given ranks by hand without ``MASTER_ADDR`` cannot
        meet the others.

        Raises:
            DistributedSetupError: ``MASTER_ADDR`` is not set.
        """
        if info.master_addr is None:
            raise DistributedSetupError(
                "RANK/WORLD_SIZE are set but MASTER_ADDR is not: start the job with `hasten launch` or torchrun, "
                "or export MASTER_ADDR and MASTER_PORT to every process."
            )
