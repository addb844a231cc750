"""Choosing the engine of an ``Accelerator``: the one place that turns its arguments and the launch into a
:class:`~hasten.strategies.base.Strategy` class, by asking the registered engines (:mod:`hasten.settings.engines`).

An engine is asked for by an ``Accelerator`` argument of its own (``deepspeed_plugin=``, ``fsdp_plugin=``, or
``strategy=`` naming it or holding its plugin), by its switch variable (``HASTEN_USE_DEEPSPEED``, set by
``hasten launch --use_deepspeed`` or the config file's ``distributed_type``), or by launch settings that only it reads.
Two engines asked for at once is an error. The N-D layout (``parallelism_config=`` or the ``parallelism_config_*``
launch settings) goes to whichever engine is asked for; when none is, the layout chooses (FSDP2, or DDP for a layout
that only splits sequences); with no layout either, the single-device engine runs on one process and DDP on several.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from typing import TYPE_CHECKING, Any

from .. import environment
from ..errors import ConfigError, did_you_mean
from ..settings import prefixed
from ..settings.engines import Argument, Engine

if TYPE_CHECKING:
    from .base import EngineSettings, Strategy


@dataclasses.dataclass(frozen=True)
class StrategyPlan:
    """The engine chosen for an Accelerator and the settings it settled, known before any state is built.

    Args:
        engine: the chosen :class:`~hasten.settings.engines.Engine`.
        strategy_class: its :class:`Strategy` subclass.
        settings: the :class:`EngineSettings` after the strategy's :meth:`Strategy.resolve`.
    """

    engine: Engine
    strategy_class: type
    settings: EngineSettings

    def build(self, state, gradient_state, precision, *, ddp_kwargs=None) -> Strategy:
        """The strategy, for ``state`` and ``precision`` built from :attr:`settings`, holding ``gradient_state``."""
        strategy = self.strategy_class.build(state, precision, self.settings, ddp_kwargs=ddp_kwargs)
        strategy.gradient_state = gradient_state
        return strategy

    def arguments(self) -> dict[str, Any]:
        """The chosen engine's arguments as settled (its plugin included), by ``Accelerator`` keyword."""
        plugin = {self.engine.plugin.name: self.settings.plugin} if self.engine.plugin else {}
        return {**plugin, **self.settings.arguments}


def plan_strategy(settings: EngineSettings, num_processes: int, strategy: Any = None) -> StrategyPlan:
    """Pick the engine for this process and let its strategy settle ``settings`` (see :meth:`Strategy.resolve`).

    Args:
        settings: the requested settings; ``settings.arguments`` holds the engines' ``Accelerator`` arguments.
        num_processes: processes in the job (DDP above 1 when nothing asks for an engine).
        strategy: ``Accelerator(strategy=...)``: a registered engine's name or an instance of its plugin class.

    The settings returned name the engine and hold its plugin (created when the launch asked for the engine
    without one) and its other arguments.
    """
    arguments = {name: value for name, value in settings.arguments.items() if value is not None}
    given = _given(arguments, strategy)
    engine = _choose(given, num_processes, arguments)
    values = _complete(engine, arguments)
    plugin = values.pop(engine.plugin.name) if engine.plugin else None
    settings = dataclasses.replace(settings, engine=engine.name, plugin=plugin, arguments=values)
    strategy_class = _load(engine.strategy)
    return StrategyPlan(engine, strategy_class, strategy_class.resolve(settings))


def _load(path: str) -> Any:
    """The object at import path ``"package.module:Name"`` (a strategy or settings class; imports its module)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _given(arguments: dict[str, Any], strategy: Any) -> dict[str, str]:
    """Engine name -> how the script asked for it (its arguments, ``strategy=``); adds ``strategy``'s plugin to
    ``arguments``."""
    given: dict[str, str] = {}
    for engine in environment.ENGINES:
        for argument in engine.arguments:
            if argument.name in arguments and not argument.layout:
                given.setdefault(engine.name, f"{argument.name}=")
    if isinstance(strategy, str):
        given.setdefault(_by_name(strategy).name, f"strategy={strategy!r}")
    elif strategy is not None:
        engine = _by_plugin(strategy)
        arguments.setdefault(engine.plugin.name, strategy)
        given.setdefault(engine.name, f"strategy={type(strategy).__name__}(...)")
    return given


def _by_name(name: str) -> Engine:
    engines = {engine.name: engine for engine in environment.ENGINES}
    if name not in engines:
        known, hint = ", ".join(engines), did_you_mean(name, engines)
        raise ConfigError(f"strategy={name!r} is not a registered engine; the engines are {known}.{hint}")
    return engines[name]


def _by_plugin(plugin: Any) -> Engine:
    for engine in environment.ENGINES:
        cls = _loaded_class(engine.plugin) if engine.plugin else None
        if cls is not None and isinstance(plugin, cls):
            return engine
    names = ", ".join(f"{e.name} ({e.plugin.cls.rpartition(':')[2]})" for e in environment.ENGINES if e.plugin)
    raise ConfigError(
        f"strategy={type(plugin).__name__}(...) is neither a registered engine's name nor its plugin; pass one of "
        f"the engines' names or plugins: {names}."
    )


def _loaded_class(argument: Argument) -> type | None:
    """The argument's class when its module is imported (an object of it exists only then), else None."""
    module, _, name = argument.cls.partition(":")
    return getattr(sys.modules[module], name, None) if module in sys.modules else None


def _choose(given: dict[str, str], num_processes: int, arguments: dict[str, Any]) -> Engine:
    """The one engine asked for by the script, a switch variable or the launch settings, else the one the layout
    asks for, else the fallback. A layout built from the launch settings is added to ``arguments``."""
    asked = dict(given)
    for engine in environment.ENGINES:
        if engine.switch and environment.get_flag(engine.switch):
            asked.setdefault(engine.name, environment.setting_source(engine.switch))
        if not given and any(_from_launch(a) and not a.layout for a in engine.arguments):
            sections = ", ".join(a.section.name for a in engine.arguments if _from_launch(a) and not a.layout)
            asked.setdefault(engine.name, f"the launch settings {sections}")
    if not asked:
        asked = _asked_by_layout(arguments)
    if len(asked) > 1:
        reasons = "; ".join(f"{name} by {why}" for name, why in asked.items())
        raise ConfigError(
            f"Several engines are asked for ({reasons}); choose one (check the Accelerator arguments, the "
            f"{prefixed('USE_')}* variables and the launch config)."
        )
    engines = {engine.name: engine for engine in environment.ENGINES}
    if asked:
        return engines[next(iter(asked))]
    wanted = "several" if num_processes > 1 else "one"
    return next(engine for engine in environment.ENGINES if engine.fallback == wanted)


def _asked_by_layout(arguments: dict[str, Any]) -> dict[str, str]:
    """Engine name -> why, for the engines whose layout argument's value (given, or built from the launch settings)
    asks for them."""
    asked: dict[str, str] = {}
    for engine in environment.ENGINES:
        for argument in (a for a in engine.arguments if a.layout):
            source = "argument" if argument.name in arguments else "launch settings"
            if argument.name not in arguments and _from_launch(argument):
                arguments[argument.name] = _load(argument.cls)()
            value = arguments.get(argument.name)
            if value is not None and argument.layout(value):
                asked.setdefault(engine.name, f"the {argument.name} {source}")
    return asked


def _from_launch(argument: Argument) -> bool:
    return argument.from_launch and argument.section is not None and environment.any_set(argument.section.rows)


def _complete(engine: Engine, arguments: dict[str, Any]) -> dict[str, Any]:
    """The chosen engine's arguments: those given, its plugin built when missing, the launch-built ones."""
    values: dict[str, Any] = {}
    for argument in engine.arguments:
        value = arguments.get(argument.name)
        if value is None and (argument is engine.plugin or _from_launch(argument)):
            value = _load(argument.cls)()
        values[argument.name] = value
    return values
