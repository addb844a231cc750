"""Compatibility namespace: ``accelerate.utils``' public names and submodules, re-exported from where they live.

No logic lives here. ``from hasten.utils import X`` and ``from hasten.utils.<submodule> import X`` (Accelerate's
layout: ``operations``, ``modeling``, ``memory``, ``imports``, ``dataclasses``, ...) give the same object; the table
is ``hasten.utils._layout.LAYOUT``. Names and submodules are resolved lazily, so importing ``hasten.utils`` stays cheap.
"""

from __future__ import annotations

import importlib

from . import tqdm as _tqdm_module  # noqa: F401 (imported once so that the submodule never shadows the function)
from ._layout import FLAT_ONLY, LAYOUT, resolve

del tqdm  # noqa: F821 (bound by the submodule import above) the package attribute ``tqdm`` is the function, as in Accelerate

_EXPORTS: dict[str, str] = {name: target for table in LAYOUT.values() for name, target in table.items()}
_EXPORTS.update(FLAT_ONLY)
_SUBMODULES = frozenset(LAYOUT)


def __getattr__(name: str):
    target = _EXPORTS.get(name)
    if target is None and name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if target is None:
        raise AttributeError(f"module 'hasten.utils' has no attribute {name!r}")
    module, attribute = resolve(target)
    value = getattr(module, attribute or name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(_EXPORTS)
