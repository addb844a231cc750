"""Everything DeepSpeed, in one folder: the settings, the config, the strategy, the checkpoints, the memory table.

- :mod:`.plugin`: ``DeepSpeedPlugin``, the settings (fields and their validation);
- :mod:`.config`: DeepSpeed JSON configs: loading, key checks, and :func:`.config.fill`, the one function
  that resolves ``"auto"`` values;
- :mod:`.schema`: every key DeepSpeed reads (the key check's table);
- :mod:`.strategy`: ``DeepSpeedStrategy``, the engine behind the Strategy interface;
- :mod:`.dummies`: ``DummyOptim``/``DummyScheduler`` (the config's optimizer and scheduler) and the CPU optimizers of
  offload;
- :mod:`.zero3`: ZeRO-3 model construction (``HfDeepSpeedConfig`` for Transformers, ``zero.Init``, MoE leaf modules);
- :mod:`.checkpoint`: reading engine checkpoints safely and merging them into one model file;
- :mod:`.memory_estimate`: the ZeRO memory table of ``hasten estimate-memory``, and the advice ``hasten launch``
  prints when a DeepSpeed process was killed for memory.

Names are imported lazily: importing this package imports neither ``deepspeed`` nor the strategy.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "DeepSpeedPlugin": "plugin",
    "DeepSpeedStrategy": "strategy",
    "DeepSpeedSchedulerWrapper": "strategy",
    "explain_deepspeed_failure": "memory_estimate",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
