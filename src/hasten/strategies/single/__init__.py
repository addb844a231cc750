"""One process on one device: :mod:`.strategy` (``SingleDeviceStrategy``) and :mod:`.engine` (its registration).

Names are imported lazily: importing this package does not import torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {"SingleDeviceStrategy": "strategy"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
