"""hasten: one PyTorch training script on a CPU, one GPU, many GPUs or many machines.

Public names are imported lazily, so ``import hasten`` is cheap and never imports optional packages.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "Accelerator": "accelerator",
    "PartialState": "state",
    "DistributedType": "enums",
    "DataLoaderConfiguration": "plugins",
    "DistributedDataParallelKwargs": "plugins",
    "GradScalerKwargs": "plugins",
    "InitProcessGroupKwargs": "plugins",
    "AutocastKwargs": "plugins",
    "ProfileKwargs": "plugins",
    "DDPCommunicationHookType": "enums",
    "skip_first_batches": "data_loader",
    "find_executable_batch_size": "memory",
    "synchronize_rng_states": "rng",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hasten' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"hasten.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__


if TYPE_CHECKING:  # pragma: no cover
    from .accelerator import Accelerator
    from .data_loader import skip_first_batches
    from .enums import DDPCommunicationHookType, DistributedType
    from .memory import find_executable_batch_size
    from .plugins import (
        AutocastKwargs,
        DataLoaderConfiguration,
        DistributedDataParallelKwargs,
        GradScalerKwargs,
        InitProcessGroupKwargs,
        ProfileKwargs,
    )
    from .rng import synchronize_rng_states
    from .state import PartialState
