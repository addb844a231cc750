"""One process on one device: nothing to distribute."""

from __future__ import annotations

import torch

from ...enums import DistributedType
from ..base import Strategy


class SingleDeviceStrategy(Strategy):
    """Runs everything on this process's device (CPU, one GPU, MPS)."""

    distributed_type = DistributedType.NO
    joins_uneven_inputs = None
    replicates_model = True

    def setup_model(
        self, model: torch.nn.Module, device_placement: bool = True, evaluation_mode: bool = False
    ) -> torch.nn.Module:
        """Move ``model`` to the device and apply the precision policy."""
        if device_placement:
            model = model.to(self.device)
        return self.precision.wrap_forward(model)
