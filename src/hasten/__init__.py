"""hasten: one PyTorch training script on a CPU, one GPU, many GPUs or many machines.

Public names are imported lazily, so ``import hasten`` is cheap and never imports optional packages.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from . import process_group_hooks
from ._version import __version__


def _runtime_group_guards():
    """The runtime's guards of the process group, imported when the first state needs them. The state sits below
    the runtime and cannot name it; the package, above both, wires them together here."""
    from .runtime import group_guards

    return group_guards


process_group_hooks.register(_runtime_group_guards)

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
    "find_executable_batch_size": "runtime.memory",
    "synchronize_rng_states": "runtime.rng",
    "DeepSpeedPlugin": "strategies.deepspeed.plugin",
    "FullyShardedDataParallelPlugin": "strategies.fsdp.plugin",
    "TorchDynamoPlugin": "plugins.dynamo",
    "init_empty_weights": "big_modeling",
    "init_on_device": "big_modeling",
    "cpu_offload": "big_modeling",
    "cpu_offload_with_hook": "big_modeling",
    "disk_offload": "big_modeling",
    "dispatch_model": "big_modeling",
    "load_checkpoint_and_dispatch": "big_modeling",
    "infer_auto_device_map": "big_modeling.device_map",
    "load_checkpoint_in_model": "big_modeling.checkpoint_loading",
    "notebook_launcher": "launchers",
    "debug_launcher": "launchers",
    "ParallelismConfig": "runtime.parallelism",
    "prepare_pippy": "compat.unsupported",
    "is_rich_available": "compat.unsupported",
    "install_as_accelerate": "accelerate_alias",
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
    from .accelerate_alias import install_as_accelerate
    from .accelerator import Accelerator
    from .big_modeling import (
        cpu_offload,
        cpu_offload_with_hook,
        disk_offload,
        dispatch_model,
        init_empty_weights,
        init_on_device,
        load_checkpoint_and_dispatch,
    )
    from .big_modeling.checkpoint_loading import load_checkpoint_in_model
    from .big_modeling.device_map import infer_auto_device_map
    from .compat.unsupported import is_rich_available, prepare_pippy
    from .data_loader import skip_first_batches
    from .enums import DDPCommunicationHookType, DistributedType
    from .launchers import debug_launcher, notebook_launcher
    from .plugins import (
        AutocastKwargs,
        DataLoaderConfiguration,
        DistributedDataParallelKwargs,
        GradScalerKwargs,
        InitProcessGroupKwargs,
        ProfileKwargs,
    )
    from .plugins.dynamo import TorchDynamoPlugin
    from .runtime.memory import find_executable_batch_size
    from .runtime.parallelism import ParallelismConfig
    from .runtime.rng import synchronize_rng_states
    from .state import PartialState
    from .strategies.deepspeed.plugin import DeepSpeedPlugin
    from .strategies.fsdp.plugin import FullyShardedDataParallelPlugin
