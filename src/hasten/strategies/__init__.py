"""Distribution engines behind one interface (:class:`Strategy`), and the one place that picks one.

The strategies are imported when used, so that importing one engine's package (``strategies.deepspeed``
for the ``estimate-memory`` command, say) does not import the others.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import TYPE_CHECKING

from .. import environment
from ..errors import ConfigError

if TYPE_CHECKING:
    from .base import EngineSettings, Strategy

_EXPORTS = {"EngineSettings": "base", "Strategy": "base", "DDPStrategy": "ddp", "SingleDeviceStrategy": "single"}


@dataclasses.dataclass(frozen=True)
class StrategyPlan:
    """The engine chosen for an Accelerator and the settings it settled, known before any state is built.

    Args:
        strategy_class: the :class:`Strategy` subclass to build.
        settings: the :class:`EngineSettings` after the strategy's :meth:`Strategy.resolve`.
    """

    strategy_class: type
    settings: EngineSettings

    def build(self, state, precision, *, ddp_kwargs=None) -> Strategy:
        """The strategy, for ``state`` and ``precision`` built from :attr:`settings`."""
        return self.strategy_class.build(state, precision, self.settings, ddp_kwargs=ddp_kwargs)


def plan_strategy(settings: EngineSettings, num_processes: int) -> StrategyPlan:
    """Pick the strategy for this process and let it settle ``settings`` (see :meth:`Strategy.resolve`).

    DeepSpeed when a ``DeepSpeedPlugin`` is given or ``HASTEN_USE_DEEPSPEED`` is set, FSDP2 when a
    ``FullyShardedDataParallelPlugin`` is given, ``HASTEN_USE_FSDP`` is set or a ``ParallelismConfig``
    is given (or set by the launch's ``parallelism_config_*`` settings; it then lays out the mesh),
    DDP when several processes run, a single device otherwise. The plugins the launch implies are
    created here and returned in the plan's settings.
    """
    deepspeed_plugin, fsdp_plugin, parallelism_config = settings.deepspeed_plugin, settings.fsdp_plugin, settings.parallelism_config
    if parallelism_config is None and deepspeed_plugin is None:
        from ..runtime.parallelism import ParallelismConfig

        parallelism_config = ParallelismConfig.from_launch_settings()
    if deepspeed_plugin is None and environment.get_flag("USE_DEEPSPEED"):
        from .deepspeed.plugin import DeepSpeedPlugin

        deepspeed_plugin = DeepSpeedPlugin()
    if fsdp_plugin is None and (environment.get_flag("USE_FSDP") or (parallelism_config is not None and deepspeed_plugin is None)):
        from .fsdp.plugin import FullyShardedDataParallelPlugin

        fsdp_plugin = FullyShardedDataParallelPlugin()
    if deepspeed_plugin is not None and fsdp_plugin is not None:
        raise ConfigError("Both a DeepSpeed plugin and an FSDP plugin are set; choose one engine (check HASTEN_USE_DEEPSPEED / HASTEN_USE_FSDP and the launch config).")
    if deepspeed_plugin is not None and parallelism_config is not None:
        raise ConfigError("A ParallelismConfig lays out FSDP2 and tensor parallelism; it cannot be combined with DeepSpeed. Choose one.")
    settings = dataclasses.replace(settings, deepspeed_plugin=deepspeed_plugin, fsdp_plugin=fsdp_plugin, parallelism_config=parallelism_config)
    strategy_class = _strategy_class(settings, num_processes)
    return StrategyPlan(strategy_class, strategy_class.resolve(settings))


def _strategy_class(settings: EngineSettings, num_processes: int) -> type:
    if settings.deepspeed_plugin is not None:
        from .deepspeed.strategy import DeepSpeedStrategy

        return DeepSpeedStrategy
    if settings.fsdp_plugin is not None:
        from .fsdp.strategy import FSDPStrategy

        return FSDPStrategy
    if num_processes > 1:
        from .ddp import DDPStrategy

        return DDPStrategy
    from .single import SingleDeviceStrategy

    return SingleDeviceStrategy


__all__ = ["DDPStrategy", "EngineSettings", "SingleDeviceStrategy", "Strategy", "StrategyPlan", "plan_strategy"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
