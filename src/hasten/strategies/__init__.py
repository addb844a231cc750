"""Distribution engines behind one interface (:class:`Strategy`), and the one place that picks one."""

from __future__ import annotations

from .. import environment
from ..errors import ConfigError
from .base import Strategy
from .ddp import DDPStrategy
from .single import SingleDeviceStrategy


def select_strategy(state, precision, *, ddp_kwargs=None, deepspeed_plugin=None, fsdp_plugin=None) -> Strategy:
    """Pick the strategy for this process and record it on ``state``.

    DeepSpeed when a ``DeepSpeedPlugin`` is given or ``HASTEN_USE_DEEPSPEED`` is set, FSDP2 when a
    ``FullyShardedDataParallelPlugin`` is given or ``HASTEN_USE_FSDP`` is set, DDP when several
    processes run, a single device otherwise.
    """
    if deepspeed_plugin is None and environment.get_flag("USE_DEEPSPEED"):
        from ..plugins.deepspeed import DeepSpeedPlugin

        deepspeed_plugin = DeepSpeedPlugin()
    if fsdp_plugin is None and environment.get_flag("USE_FSDP"):
        from ..plugins.fsdp import FullyShardedDataParallelPlugin

        fsdp_plugin = FullyShardedDataParallelPlugin()
    if deepspeed_plugin is not None and fsdp_plugin is not None:
        raise ConfigError("Both a DeepSpeed plugin and an FSDP plugin are set; choose one engine (check HASTEN_USE_DEEPSPEED / HASTEN_USE_FSDP and the launch config).")
    state.deepspeed_plugin, state.fsdp_plugin = deepspeed_plugin, fsdp_plugin
    if deepspeed_plugin is not None:
        from .deepspeed import DeepSpeedStrategy

        return DeepSpeedStrategy(state, precision, deepspeed_plugin)
    if fsdp_plugin is not None:
        from .fsdp import FSDPStrategy

        return FSDPStrategy(state, precision, fsdp_plugin)
    if state.num_processes > 1:
        return DDPStrategy(state, precision, ddp_kwargs=ddp_kwargs)
    return SingleDeviceStrategy(state, precision)


__all__ = ["DDPStrategy", "SingleDeviceStrategy", "Strategy", "select_strategy"]
