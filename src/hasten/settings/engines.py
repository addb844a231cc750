"""The engine registry: what hasten knows of each training engine, declared once by one :class:`Engine` registration.

An engine lives in its own folder (``hasten/strategies/<engine>/``); its ``engine.py`` holds the registration,
``ENGINE = Engine(...)``: its name, the distributed type(s) it runs, its ``Strategy`` class and settings (plugin)
class by import path, the config file sections it reads, its switch variable and ``--use_<engine>`` flag, its
``hasten config`` questions, the ``Accelerator`` arguments it arrives through and the package it needs. The config
file, the launch flags, the documented variables, the dialogue, the process state and the choice of strategy
(:func:`hasten.strategies.plan.plan_strategy`) loop over the registered engines.

A registration module imports nothing but ``hasten.settings``: it is imported by the command line, which must stay
fast (no torch), and by :mod:`hasten.environment`, which lists the engines' variables. The built-in registrations
are :data:`BUILT_IN`; more are named by the ``HASTEN_ENGINES`` variable (comma-separated module names), read once
per process by :mod:`hasten.environment`, which holds the result as ``environment.ENGINES``.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from ..errors import ConfigError
from . import Section

BUILT_IN = (
    "hasten.strategies.single.engine",
    "hasten.strategies.ddp.engine",
    "hasten.strategies.deepspeed.engine",
    "hasten.strategies.fsdp.engine",
)


@dataclass(frozen=True, slots=True)
class Requirement:
    """The package an engine needs: ``module`` to import, ``what`` it is, the ``extra`` of hasten that installs it."""

    module: str
    what: str
    extra: str

    @property
    def installed(self) -> bool:
        """Whether the package can be imported here (looked up, not imported)."""
        return importlib.util.find_spec(self.module) is not None

    @property
    def hint(self) -> str:
        """The pip command that installs it."""
        return f"pip install 'hasten[{self.extra}]'"


@dataclass(frozen=True, slots=True)
class Argument:
    """A keyword of ``Accelerator(...)`` (and attribute of ``AcceleratorState``) that brings an engine's settings.

    Args:
        name: the keyword, e.g. ``"fsdp_plugin"``.
        cls: import path (``"module:Class"``) of the settings object it takes.
        section: the config file section whose rows fill that object from the launch settings.
        from_launch: the object is built from the launch settings whenever one of ``section``'s variables is set
            (``parallelism_config_*``), which chooses the engine (a ``layout`` argument only as said below).
        layout: set for an argument that several engines take (``parallelism_config``, the N-D layout): it never
            conflicts with the engine asked for otherwise (an argument, a switch), which takes it; when nothing else
            asks for an engine, ``layout(value)`` tells whether the value asks for this one.
    """

    name: str
    cls: str
    section: Section | None = None
    from_launch: bool = False
    layout: Callable[[Any], bool] | None = None


@dataclass(frozen=True, slots=True)
class WeightsMerge:
    """How ``hasten merge-weights`` turns an engine's sharded checkpoint into one model file.

    ``label`` names the format in messages ("DeepSpeed ZeRO"), ``expects`` says what its folder holds (for the
    error when no engine recognises a folder); ``holds(folder)`` tells whether a folder is such a checkpoint and
    ``merge(folder, output, safe_serialization, max_shard_size)`` writes the merged weights and returns the files.
    Both may import the engine's modules (they run only in that command).
    """

    label: str
    expects: str
    holds: Callable[[Any], bool]
    merge: Callable[[Any, Any, bool, str], list]


@dataclass(frozen=True, slots=True)
class CheckpointReading:
    """How a checkpoint this engine saved is read by parameter name, for ``load_state`` under another engine.

    ``holds(reader, index)`` tells whether prepared model ``index`` of an open checkpoint is kept in this engine's own
    files; ``read(reader, index, module)`` returns that model's training state by parameter name (a
    :class:`~hasten.strategies.engine_change.StateByName`: weights, optimizer state, parameter groups, buffers),
    everything read and checked (``module``: the live model, whose names tell parameters from buffers). Both may
    import the engine's modules (they run only on such a load). ``left_behind``: what of this engine's state another
    engine does not take, in words for the resume's warning line (empty: everything carries over).
    """

    holds: Callable[[Any, int], bool]
    read: Callable[[Any, int, Any], Any]
    left_behind: str = ""


@dataclass(frozen=True, slots=True)
class Dialogue:
    """How ``hasten config`` offers an engine: a yes/no ``question`` asked when the machine type answered is one of
    ``offered_for``; after a yes, ``ask(asker, answers)`` asks the engine's settings and returns the config sections
    it fills (section name -> key -> value). ``gpu_ids``: the dialogue then asks which GPUs to use."""

    question: str
    offered_for: tuple[str, ...]
    ask: Callable[[Any, dict], dict]
    gpu_ids: bool = True


@dataclass(frozen=True, slots=True)
class Engine:
    """One training engine.

    Args:
        name: registry name (``Accelerator(strategy="deepspeed")``).
        strategy: import path of its :class:`~hasten.strategies.base.Strategy` class.
        distributed_types: what ``distributed_type`` it runs: one value for an engine that fixes it (DEEPSPEED), the
            values the device decides between otherwise (DDP: MULTI_CPU, MULTI_GPU, MULTI_XPU).
        arguments: its ``Accelerator`` keywords; the first that is not a ``layout`` is its settings (plugin) class,
            built when the engine is chosen without one.
        sections: its config file sections, in the order of their ``hasten launch`` option groups.
        switch: the variable (without prefix) that chooses it, e.g. ``USE_DEEPSPEED``, meaning ``switch_help``; its
            flag is its lower case (``--use_deepspeed``), with help ``flag_help``.
        fallback: ``"one"`` or ``"several"``: chosen when nothing asks for an engine and one process, or several, run.
        requirement: the package it needs (checked by ``hasten launch`` and the dialogue).
        dialogue: how ``hasten config`` offers it.
        settles_precision: its own configuration decides the mixed precision (a DeepSpeed config's fp16/bf16).
        variables: other variables it reads or writes (name without prefix -> meaning).
        launch_variables: ``f(settings) -> {variable: value}``, more variables ``hasten launch`` exports when it runs.
        launch_warnings: ``f(settings) -> [line]``, settings it does not act on, when it runs.
        explain_failure: ``f(variables, exit code) -> advice or None``, for a worker that failed under it.
        merge_weights: how ``hasten merge-weights`` merges its sharded checkpoints (:class:`WeightsMerge`).
        checkpoint_reading: how another engine reads the checkpoints it saves (:class:`CheckpointReading`).
        memory_table: ``f(arguments, total parameters, largest layer's parameters) -> [line]``, its part of
            ``hasten estimate-memory``'s report (the parsed command line holds ``num_gpus``, ``num_nodes``, ...).
    """

    name: str
    strategy: str
    distributed_types: tuple[str, ...]
    arguments: tuple[Argument, ...] = ()
    sections: tuple[Section, ...] = ()
    switch: str | None = None
    switch_help: str = ""
    flag_help: str = ""
    fallback: str | None = None
    requirement: Requirement | None = None
    dialogue: Dialogue | None = None
    settles_precision: bool = False
    variables: dict[str, str] = field(default_factory=dict)
    launch_variables: Callable[[Any], dict[str, str]] | None = None
    launch_warnings: Callable[[Any], list[str]] | None = None
    explain_failure: Callable[[dict, int], str | None] | None = None
    merge_weights: WeightsMerge | None = None
    checkpoint_reading: CheckpointReading | None = None
    memory_table: Callable[[Any, int, int], list[str]] | None = None

    @property
    def flag(self) -> str | None:
        """The ``hasten launch`` switch that chooses it (without ``--``)."""
        return self.switch.lower() if self.switch else None

    @property
    def distributed_type(self) -> str | None:
        """The distributed type it fixes, or None when the device decides."""
        return self.distributed_types[0] if len(self.distributed_types) == 1 else None

    @property
    def plugin(self) -> Argument | None:
        """Its settings argument (the first of :attr:`arguments` that is not a layout), or None."""
        return next((argument for argument in self.arguments if not argument.layout), None)


def load_engines(modules: Iterable[str]) -> tuple[Engine, ...]:
    """The registrations (``ENGINE``) of ``modules``, in order; a clear error for a module that does not register
    one, and for two engines that claim the same name, distributed type, variable or argument."""
    engines: list[Engine] = []
    for module in dict.fromkeys(name.strip() for name in modules if name.strip()):
        try:
            engine = getattr(importlib.import_module(module), "ENGINE", None)
        except ImportError as exc:
            raise ConfigError(
                f"Engine registration module {module!r} cannot be imported ({exc}); check HASTEN_ENGINES."
            ) from None
        if not isinstance(engine, Engine):
            raise ConfigError(
                f"Engine registration module {module!r} defines no ENGINE = hasten.settings.engines.Engine(...)."
            )
        _check_unique(engine, engines, module)
        engines.append(engine)
    return tuple(engines)


def _check_unique(engine: Engine, engines: list[Engine], module: str) -> None:
    for other in engines:
        claims = {
            "name": {engine.name} & {other.name},
            "distributed type": set(engine.distributed_types) & set(other.distributed_types),
            "switch variable": {engine.switch} & {other.switch} - {None},
            "argument": {a.name for a in engine.arguments if not a.layout}
            & {a.name for a in other.arguments if not a.layout},
        }
        for what, shared in claims.items():
            if shared:
                raise ConfigError(
                    f"Engine {engine.name!r} (from {module}) claims the {what} {sorted(shared)[0]!r} of engine "
                    f"{other.name!r}; each engine needs its own."
                )
