"""Nested state (optimizer, scheduler, RNG, custom objects) as JSON structure plus safetensors tensors.

No pickle: loading a checkpoint never runs code. The JSON tree holds plain values; markers stand for
what JSON lacks:

* ``{"__hasten_tensor__": key}``: a tensor stored under ``key`` in the companion safetensors file;
* ``{"__hasten_tuple__": [...]}``: a tuple;
* ``{"__hasten_map__": [[key, value], ...]}``: a dict whose keys are not all strings (optimizer
  state is keyed by parameter index);
* ``{"__hasten_dtype__": "float32"}``: a ``torch.dtype``.

Anything else (sets, arbitrary objects) is refused with the path of the value and a hint.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ..errors import CheckpointError

_TENSOR, _TUPLE, _MAP, _DTYPE, _FLOAT = (
    "__hasten_tensor__",
    "__hasten_tuple__",
    "__hasten_map__",
    "__hasten_dtype__",
    "__hasten_float__",
)
_MARKERS = {_TENSOR, _TUPLE, _MAP, _DTYPE, _FLOAT}


def encode(obj: Any, what: str = "state") -> tuple[Any, dict[str, torch.Tensor]]:
    """Split ``obj`` into a JSON-compatible tree and a dict of tensors (keys are the values' paths)."""
    tensors: dict[str, torch.Tensor] = {}
    return _encode(obj, what, tensors), tensors


def _encode(obj: Any, path: str, tensors: dict) -> Any:
    if isinstance(obj, torch.Tensor):
        key = path
        tensors[key] = obj.detach()
        return {_TENSOR: key}
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {_FLOAT: repr(obj)}
    if isinstance(obj, np.generic):
        return _encode(obj.item(), path, tensors)
    if isinstance(obj, torch.dtype):
        return {_DTYPE: str(obj).removeprefix("torch.")}
    if isinstance(obj, tuple):
        return {_TUPLE: [_encode(v, f"{path}.{i}", tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, f"{path}.{i}", tensors) for i, v in enumerate(obj)]
    if isinstance(obj, Mapping):
        if all(isinstance(k, str) for k in obj) and not _MARKERS & set(obj):
            return {k: _encode(v, f"{path}.{k}", tensors) for k, v in obj.items()}
        items = []
        for k, v in obj.items():
            if not isinstance(k, (str, int, bool)) and k is not None:
                raise CheckpointError(
                    f"{path} has a key of type {type(k).__name__} ({k!r}); checkpoint state keys must be str or int."
                )
            items.append([k, _encode(v, f"{path}.{k}", tensors)])
        return {_MAP: items}
    raise CheckpointError(
        f"{path} is a {type(obj).__name__}, which a checkpoint cannot store without pickle. State dicts may hold "
        "tensors, numbers, strings, booleans, None, dtypes and lists/tuples/dicts of these; convert the value "
        "in the object's state_dict() (and back in load_state_dict())."
    )


def decode(tree: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Rebuild the object split by :func:`encode`."""
    if isinstance(tree, list):
        return [decode(v, tensors) for v in tree]
    if not isinstance(tree, dict):
        return tree
    if len(tree) == 1:
        ((key, value),) = tree.items()
        if key == _TENSOR:
            if value not in tensors:
                raise CheckpointError(
                    f"the checkpoint's structure refers to tensor {value!r}, which its tensor file lacks."
                )
            return tensors[value]
        if key == _TUPLE:
            return tuple(decode(v, tensors) for v in value)
        if key == _MAP:
            return {k: decode(v, tensors) for k, v in value}
        if key == _DTYPE:
            return getattr(torch, value)
        if key == _FLOAT:
            return float(value)
    return {k: decode(v, tensors) for k, v in tree.items()}
