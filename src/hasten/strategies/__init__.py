"""Distribution engines behind one interface (:class:`Strategy`): one folder per engine (``single/``, ``ddp/``,
``fsdp/``, ``deepspeed/``), each registered by its ``engine.py`` (see :mod:`hasten.settings.engines`), and
:mod:`.plan`, the one place that picks one.

Names are imported lazily, so that importing one engine's package (its registration for the command line, or
``strategies.deepspeed`` for the ``estimate-memory`` command) imports neither torch nor the other engines.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "EngineSettings": "base",
    "Strategy": "base",
    "DDPStrategy": "ddp",
    "SingleDeviceStrategy": "single",
    "StrategyPlan": "plan",
    "plan_strategy": "plan",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
