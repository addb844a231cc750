"""Distribution engines behind one interface (:class:`Strategy`), and the one place that picks one.

The strategies are imported when used, so that importing one engine's package (``strategies.deepspeed``
for the ``estimate-memory`` command, say) does not import the others.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .. import environment
from ..errors import ConfigError

if TYPE_CHECKING:
    from .base import Strategy

_EXPORTS = {"Strategy": "base", "DDPStrategy": "ddp", "SingleDeviceStrategy": "single"}


def select_strategy(state, precision, *, ddp_kwargs=None, deepspeed_plugin=None, fsdp_plugin=None, parallelism_config=None) -> Strategy:
    """Pick the strategy for this process and record it on ``state``.

    DeepSpeed when a ``DeepSpeedPlugin`` is given or ``HASTEN_USE_DEEPSPEED`` is set, FSDP2 when a
    ``FullyShardedDataParallelPlugin`` is given, ``HASTEN_USE_FSDP`` is set or a ``ParallelismConfig``
    is given (or set by the launch's ``parallelism_config_*`` settings; it then lays out the mesh),
    DDP when several processes run, a single device otherwise.
    """
    if parallelism_config is None and deepspeed_plugin is None:
        from ..runtime.parallelism import ParallelismConfig

        parallelism_config = ParallelismConfig.from_launch_settings()
    state.parallelism_config = parallelism_config
    if deepspeed_plugin is None and environment.get_flag("USE_DEEPSPEED"):
        from .deepspeed.plugin import DeepSpeedPlugin

        deepspeed_plugin = DeepSpeedPlugin()
    if fsdp_plugin is None and (environment.get_flag("USE_FSDP") or (parallelism_config is not None and deepspeed_plugin is None)):
        from .fsdp.plugin import FullyShardedDataParallelPlugin

        fsdp_plugin = FullyShardedDataParallelPlugin()
    if deepspeed_plugin is not None and fsdp_plugin is not None:
        raise ConfigError("Both a DeepSpeed plugin and an FSDP plugin are set; choose one engine (check HASTEN_USE_DEEPSPEED / HASTEN_USE_FSDP and the launch config).")
    state.deepspeed_plugin, state.fsdp_plugin = deepspeed_plugin, fsdp_plugin
    if deepspeed_plugin is not None:
        from .deepspeed.strategy import DeepSpeedStrategy

        if parallelism_config is not None:
            raise ConfigError("A ParallelismConfig lays out FSDP2 and tensor parallelism; it cannot be combined with DeepSpeed. Choose one.")

        return DeepSpeedStrategy(state, precision, deepspeed_plugin)
    if fsdp_plugin is not None:
        from .fsdp.strategy import FSDPStrategy

        return FSDPStrategy(state, precision, fsdp_plugin, parallelism_config=parallelism_config)
    from .ddp import DDPStrategy
    from .single import SingleDeviceStrategy

    if state.num_processes > 1:
        return DDPStrategy(state, precision, ddp_kwargs=ddp_kwargs)
    return SingleDeviceStrategy(state, precision)


__all__ = ["DDPStrategy", "SingleDeviceStrategy", "Strategy", "select_strategy"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
