"""Everything FSDP2, in one folder: the settings, the strategy and the checkpoints.

- :mod:`.plugin`: ``FullyShardedDataParallelPlugin``, the settings (fields and their validation);
- :mod:`.strategy`: ``FSDPStrategy``, ``fully_shard`` behind the Strategy interface;
- :mod:`.wrapping`: which submodules get their own ``fully_shard`` and which parameters are left alone;
- :mod:`.checkpoint`: sharded (DCP) and full checkpoints, Accelerate's ``save_fsdp_*``/``load_fsdp_*``, merging.

Names are imported lazily: importing this package imports neither the strategy nor ``torch.distributed.fsdp``.
"""

from __future__ import annotations

import importlib

_EXPORTS = {"FullyShardedDataParallelPlugin": "plugin", "FSDPStrategy": "strategy"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
