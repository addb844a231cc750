"""Turning user values into what trackers can store, without crashing on odd types.

Two jobs:

- :func:`sanitize_config` makes a run configuration JSON-compatible: tensors and NumPy values
  become numbers or lists, paths become strings, enums their value, dataclasses and namespaces
  dicts, functions and classes their qualified name. What cannot be converted is dropped and all
  dropped keys are named in one warning.
- :func:`tensors_to_numbers` turns the one-element tensors of a ``log`` call into Python numbers
  with one device-to-host copy per (device, dtype) group, not one ``.item()`` per value.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import enum
import inspect
import json
import os
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ..errors import ConfigError

# Tensors and arrays up to this many elements are stored as lists in a configuration.
MAX_CONFIG_ELEMENTS = 1024

_SCALARS = (bool, int, float, str, type(None))


class _Dropped:
    """Marker for a value that could not be converted."""


_DROP = _Dropped()


def _array_value(value: Any, path: str, dropped: list[str]) -> Any:
    """A tensor / NumPy array / NumPy scalar as a number or a (nested) list."""
    size = value.numel() if isinstance(value, torch.Tensor) else value.size
    if size == 1:
        return value.item()
    if size <= MAX_CONFIG_ELEMENTS:
        return value.tolist()
    dropped.append(f"{path} ({type(value).__name__} with {size} elements; at most {MAX_CONFIG_ELEMENTS} are stored)")
    return _DROP


def _mapping_value(value: Mapping, path: str, dropped: list[str], seen: set[int]) -> dict:
    converted = {}
    for key, item in value.items():
        name = key.value if isinstance(key, enum.Enum) else key
        name = name if isinstance(name, str) else str(name)
        result = _convert(item, f"{path}.{name}" if path else name, dropped, seen)
        if result is not _DROP:
            converted[name] = result
    return converted


def _sequence_value(value, path: str, dropped: list[str], seen: set[int]) -> list:
    items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
    converted = (_convert(item, f"{path}[{index}]", dropped, seen) for index, item in enumerate(items))
    return [item for item in converted if item is not _DROP]


def _object_value(value: Any, path: str, dropped: list[str]) -> Any:
    """Leaf objects that have an obvious text or number form."""
    if isinstance(value, enum.Enum):
        inner = value.value
        return inner if type(inner) in _SCALARS else value.name
    if isinstance(value, (torch.Tensor, np.ndarray, np.generic)):
        return _array_value(value, path, dropped)
    if isinstance(value, _SCALARS):  # a subclass of a plain type: store the plain value
        return next(kind(value) for kind in (bool, int, float, str) if isinstance(value, kind))
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        return value.isoformat()
    if inspect.isclass(value) or inspect.isroutine(value):
        return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', repr(value))}"
    dropped.append(f"{path} ({type(value).__name__})")
    return _DROP


def _convert(value: Any, path: str, dropped: list[str], seen: set[int]) -> Any:
    if type(value) in _SCALARS:
        return value
    container = isinstance(value, (Mapping, list, tuple, set, frozenset, argparse.Namespace)) or (
        dataclasses.is_dataclass(value) and not isinstance(value, type)
    )
    if not container:
        return _object_value(value, path, dropped)
    if id(value) in seen:
        dropped.append(f"{path} (refers to itself)")
        return _DROP
    seen.add(id(value))
    try:
        if isinstance(value, argparse.Namespace):
            return _mapping_value(vars(value), path, dropped, seen)
        if isinstance(value, Mapping):
            return _mapping_value(value, path, dropped, seen)
        if isinstance(value, (list, tuple, set, frozenset)):
            return _sequence_value(value, path, dropped, seen)
        fields = {field.name: getattr(value, field.name) for field in dataclasses.fields(value)}
        return _mapping_value(fields, path, dropped, seen)
    finally:
        seen.discard(id(value))


def to_json_compatible(value: Any, path: str = "") -> tuple[Any, list[str]]:
    """Convert ``value`` to JSON-compatible data.

    Args:
        value: anything.
        path: the name of ``value`` in messages (``"config"``, ``"loss"``).

    Returns:
        ``(converted, dropped)``: the converted value (``None`` when ``value`` itself could not be
        converted) and the paths of the parts that were dropped, each with its type.
    """
    dropped: list[str] = []
    converted = _convert(value, path, dropped, set())
    return (None if converted is _DROP else converted), dropped


def sanitize_config(config: Any, warn: bool = True) -> dict:
    """Make a run configuration JSON-compatible, warning once about what had to be dropped.

    Accepts a dict (or any mapping), a dataclass instance or an ``argparse.Namespace``. Nested
    containers are converted recursively; see the module docstring for the rules.

    Args:
        config: the configuration given to ``init_trackers``.
        warn: emit the warning naming the dropped keys.

    Returns:
        A new dict of JSON-compatible values.

    Raises:
        ConfigError: ``config`` is not a mapping, dataclass or namespace.
    """
    is_record = isinstance(config, (Mapping, argparse.Namespace)) or (
        dataclasses.is_dataclass(config) and not isinstance(config, type)
    )
    if not is_record:
        raise ConfigError(
            "init_trackers(config=...) must be a dict (or a dataclass / argparse.Namespace), got "
            f"{type(config).__name__}. "
            "Pass e.g. config={'lr': 1e-3, 'batch_size': 32}."
        )
    converted, dropped = to_json_compatible(config)
    if dropped and warn:
        warnings.warn(
            f"These configuration values cannot be stored by the trackers and were left out: {', '.join(dropped)}. "
            "Convert them to numbers, strings, lists or dicts to record them.",
            UserWarning,
            stacklevel=3,
        )
    return converted


def flatten(config: Mapping, separator: str = "/") -> dict[str, Any]:
    """Flatten nested dicts into one level, joining keys with ``separator``; lists become JSON text.

    Used for trackers whose parameters are flat (TensorBoard hparams, MLflow params).
    """
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            for inner_key, inner_value in flatten(value, separator).items():
                flat[f"{key}{separator}{inner_key}"] = inner_value
        elif isinstance(value, (list, tuple)):
            flat[key] = json.dumps(value)
        else:
            flat[key] = value
    return flat


def _collect_tensors(values: Mapping, out: dict, pending: list) -> None:
    """Copy ``values`` into ``out``, recording one-element tensors in ``pending`` for conversion."""
    for key, value in values.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            pending.append((out, key, value))
            out[key] = value
        elif isinstance(value, Mapping):
            out[key] = {}
            _collect_tensors(value, out[key], pending)
        elif isinstance(value, (np.ndarray, np.generic)) and value.size == 1:
            out[key] = value.item()
        else:
            out[key] = value


def tensors_to_numbers(values: Mapping) -> dict:
    """A copy of ``values`` with every one-element tensor (also inside nested dicts) as a Python number.

    Tensors on the same device with the same dtype are stacked and copied to the host together, so
    logging ten GPU scalars costs one synchronisation instead of ten. Other values, including
    tensors with several elements, are kept as they are.

    Args:
        values: the dict given to ``log``.

    Returns:
        A new dict; ``values`` is not modified.
    """
    out: dict = {}
    pending: list = []
    _collect_tensors(values, out, pending)
    groups: dict[tuple, list] = {}
    for entry in pending:
        tensor = entry[2]
        groups.setdefault((tensor.device, tensor.dtype), []).append(entry)
    for entries in groups.values():
        if len(entries) == 1:
            numbers = [entries[0][2].item()]
        else:
            numbers = torch.stack([tensor.detach().reshape(()) for _, _, tensor in entries]).tolist()
        for (container, key, _), number in zip(entries, numbers):
            container[key] = number
    return out
