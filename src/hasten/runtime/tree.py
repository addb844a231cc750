"""Tensor utilities on arbitrarily nested structures of tensors: the ground floor under the collectives.

Every function accepts a tensor or a list / tuple / namedtuple / dict (any ``Mapping``, such as a
Transformers ``BatchEncoding``) nesting tensors, and returns the same structure. A value that is not
a tensor where one is required raises ``TypeError`` naming its path, e.g. ``batch['labels'][2]``.
Nothing here talks to other processes (the collectives are in :mod:`hasten.runtime.operations`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Callable

import torch


class CannotPadNestedTensorWarning(UserWarning):
    """Raised as a warning when ``pad_across_processes`` meets a nested tensor it cannot pad."""


def is_torch_tensor(tensor) -> bool:
    """True for ``torch.Tensor`` instances."""
    return isinstance(tensor, torch.Tensor)


def is_namedtuple(data) -> bool:
    """True for instances of ``collections.namedtuple`` / ``typing.NamedTuple`` classes."""
    return isinstance(data, tuple) and hasattr(data, "_fields") and hasattr(data, "_asdict")


def honor_type(obj, generator):
    """Build an object of ``type(obj)`` (list, tuple or namedtuple) from ``generator``."""
    if is_namedtuple(obj):
        return type(obj)(*list(generator))
    return type(obj)(generator)


def _path_key(key) -> str:
    return f"[{key!r}]"


class _WrongLeaf(Exception):
    """Raised inside :func:`_apply` at a leaf of the wrong type; the path is worked out only then."""


def _apply(func, data, test_type, error_on_other_type, args, kwargs):
    if test_type(data):
        return func(data, *args, **kwargs)
    if isinstance(data, (tuple, list)):
        return honor_type(data, (_apply(func, item, test_type, error_on_other_type, args, kwargs) for item in data))
    if isinstance(data, Mapping):
        return type(data)({k: _apply(func, v, test_type, error_on_other_type, args, kwargs) for k, v in data.items()})
    if error_on_other_type:
        raise _WrongLeaf
    return data


def _wrong_leaf_error(func, data, test_type) -> TypeError:
    """The ``TypeError`` naming the path of the first leaf of ``data`` that fails ``test_type``."""
    path, leaf = _first_wrong_leaf(data, "data", test_type)
    name = getattr(func, "__name__", "this operation")
    return TypeError(
        f"{path} is a {type(leaf).__name__} ({leaf!r:.60}), but {name} needs tensors at every leaf of the structure "
        "(nested lists, tuples, namedtuples and dicts of torch.Tensor). Convert it with torch.as_tensor, "
        "or move it out of the structure."
    )


def _first_wrong_leaf(data, path: str, test_type):
    if test_type(data):
        return None
    if isinstance(data, (tuple, list)):
        items = ((path + f"[{i}]", item) for i, item in enumerate(data))
    elif isinstance(data, Mapping):
        items = ((path + _path_key(k), v) for k, v in data.items())
    else:
        return path, data
    for item_path, item in items:
        found = _first_wrong_leaf(item, item_path, test_type)
        if found is not None:
            return found
    return None


def recursively_apply(func: Callable, data, *args, test_type=is_torch_tensor, error_on_other_type=False, **kwargs):
    """Apply ``func`` to every leaf of ``data`` that passes ``test_type``, keeping the structure.

    Args:
        func: called as ``func(leaf, *args, **kwargs)``.
        data: a tensor or nested list/tuple/namedtuple/Mapping.
        test_type: predicate selecting the leaves to transform (default: tensors).
        error_on_other_type: raise ``TypeError`` naming the path of any other leaf instead of keeping it.
    """
    if test_type is is_torch_tensor and not args and not kwargs:  # fast paths: a tensor, a flat tuple/list/dict of tensors
        if isinstance(data, torch.Tensor):
            return func(data)
        kind = type(data)
        if (kind is tuple or kind is list) and all(isinstance(t, torch.Tensor) for t in data):
            return kind([func(t) for t in data])
        if kind is dict and all(isinstance(t, torch.Tensor) for t in data.values()):
            return {k: func(t) for k, t in data.items()}
    try:
        return _apply(func, data, test_type, error_on_other_type, args, kwargs)
    except _WrongLeaf:
        raise _wrong_leaf_error(func, data, test_type) from None


def _leaves(data, test_type=is_torch_tensor):
    if test_type(data):
        yield data
    elif isinstance(data, (tuple, list)):
        for item in data:
            yield from _leaves(item, test_type)
    elif isinstance(data, Mapping):
        for item in data.values():
            yield from _leaves(item, test_type)


def _require_tensors(data) -> None:
    if isinstance(data, torch.Tensor) or (type(data) in (tuple, list) and all(isinstance(t, torch.Tensor) for t in data)):
        return  # the common case, checked without walking the structure
    recursively_apply(lambda t: t, data, error_on_other_type=True)


def send_to_device(tensor, device, non_blocking: bool = False, skip_keys: list[str] | str | None = None):
    """Move every tensor of a nested structure to ``device``.

    Args:
        tensor: the structure; objects with a ``.to`` method (e.g. ``BatchEncoding``) are moved too.
        device: target device.
        non_blocking: asynchronous copy (effective from pinned memory).
        skip_keys: keys of a mapping whose values stay where they are.
    """
    if isinstance(skip_keys, str):
        skip_keys = [skip_keys]
    return _send(tensor, device, non_blocking, skip_keys or ())


def _send(data, device, non_blocking, skip_keys):
    if isinstance(data, torch.Tensor):
        return data.to(device, non_blocking=non_blocking)
    if isinstance(data, (tuple, list)):
        return honor_type(data, (_send(item, device, non_blocking, skip_keys) for item in data))
    if isinstance(data, Mapping):
        return type(data)({k: v if k in skip_keys else _send(v, device, non_blocking, skip_keys) for k, v in data.items()})
    if hasattr(data, "to") and callable(data.to):
        try:
            return data.to(device, non_blocking=non_blocking)
        except TypeError:
            return data.to(device)
    return data


def get_data_structure(data):
    """The structure of ``data`` with each tensor replaced by its shape and dtype (a ``SimpleNamespace``)."""
    from types import SimpleNamespace

    return recursively_apply(lambda t: SimpleNamespace(shape=tuple(t.shape), dtype=t.dtype), data)


def get_shape(data):
    """The structure of ``data`` with each tensor replaced by its shape as a list."""
    return recursively_apply(lambda t: list(t.shape), data)


def initialize_tensors(data_structure):
    """Allocate empty tensors following a structure made by :func:`get_data_structure`."""
    return recursively_apply(
        lambda spec: torch.empty(spec.shape, dtype=spec.dtype), data_structure, test_type=lambda x: hasattr(x, "shape") and hasattr(x, "dtype")
    )


def find_batch_size(data) -> int:
    """Size of the first dimension of the first tensor in ``data``; ``TypeError`` when there is none."""
    for leaf in _leaves(data):
        if leaf.ndim == 0:
            raise TypeError("find_batch_size found a 0-dimensional tensor; a batch needs a first dimension.")
        return leaf.shape[0]
    raise TypeError(f"find_batch_size needs a tensor or a structure holding tensors, got {type(data).__name__}.")


def ignorant_find_batch_size(data) -> int | None:
    """Like :func:`find_batch_size` but returns None instead of raising."""
    try:
        return find_batch_size(data)
    except TypeError:
        return None


def listify(data):
    """Turn every tensor of ``data`` into (nested) Python lists or numbers."""
    return recursively_apply(lambda t: t.tolist() if t.ndim else t.item(), data)


def _is_half(value) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype in (torch.float16, torch.bfloat16)


def _to_fp32(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.float()


def convert_to_fp32(tensor):
    """Cast every fp16/bf16 tensor of a nested structure to fp32."""
    return recursively_apply(_to_fp32, tensor, test_type=_is_half)


class ConvertOutputsToFp32:
    """Wrap a forward function so that its half-precision outputs come back in fp32 (picklable)."""

    def __init__(self, model_forward):
        self.model_forward = model_forward
        functools.update_wrapper(self, model_forward)

    def __call__(self, *args, **kwargs):
        return convert_to_fp32(self.model_forward(*args, **kwargs))

    def __getstate__(self):
        raise TypeError("A forward wrapped by hasten's output conversion cannot be pickled; unwrap the model first (Accelerator.unwrap_model).")


def convert_outputs_to_fp32(model_forward):
    """Decorator form of :class:`ConvertOutputsToFp32`."""
    return ConvertOutputsToFp32(model_forward)


def find_device(data) -> torch.device | None:
    """Device of the first tensor found in ``data`` (None when there is none)."""
    for leaf in _leaves(data):
        return leaf.device
    return None


def slice_tensors(data, tensor_slice, process_index=None, num_processes=None):
    """Apply ``tensor_slice`` (a ``slice``) to every tensor of ``data``."""
    return recursively_apply(lambda t: t[tensor_slice], data)


def concatenate(data: list, dim: int = 0):
    """Concatenate a list of identically structured nested tensors along ``dim``."""
    if not isinstance(data, (list, tuple)) or len(data) == 0:
        raise TypeError(f"concatenate needs a non-empty list of structures, got {type(data).__name__}.")
    first = data[0]
    if isinstance(first, (tuple, list)):
        return honor_type(first, (concatenate([d[i] for d in data], dim=dim) for i in range(len(first))))
    if isinstance(first, Mapping):
        return type(first)({k: concatenate([d[k] for d in data], dim=dim) for k in first})
    if not isinstance(first, torch.Tensor):
        raise TypeError(f"concatenate can only join tensors, got {type(first).__name__}.")
    return torch.cat(list(data), dim=dim)


def pad_input_tensors(tensor, batch_size: int, num_processes: int, dim: int = 0):
    """Pad the batch dimension (repeating the last sample) so that it divides by ``num_processes``."""

    def _one(t):
        remainder = batch_size % num_processes
        if remainder == 0 or t.ndim == 0:
            return t
        extra = num_processes - remainder
        last = t.narrow(dim, t.shape[dim] - 1, 1)
        return torch.cat([t] + [last] * extra, dim=dim)

    return recursively_apply(_one, tensor)


def split_for_process(inputs, num_processes: int, process_index: int, apply_padding: bool = False):
    """This process's contiguous share of ``inputs`` (list, tuple, tensor, or dict of those)."""
    if isinstance(inputs, Mapping):
        lengths = {k: len(v) for k, v in inputs.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"split_between_processes needs every value of the dict to have the same length; got {lengths}.")
        return type(inputs)({k: split_for_process(v, num_processes, process_index, apply_padding) for k, v in inputs.items()})
    length = len(inputs)
    per_process, extras = divmod(length, num_processes)
    start = process_index * per_process + min(process_index, extras)
    end = start + per_process + (1 if process_index < extras else 0)
    share = inputs[start:end]
    if not apply_padding or extras == 0 or length == 0:
        return share
    missing = per_process + 1 - (end - start)
    if missing == 0:
        return share
    filler = inputs[-1:] if end - start == 0 else share[-1:]
    if isinstance(share, torch.Tensor):
        return torch.cat([share] + [filler] * missing, dim=0)
    return share + type(share)(filler) * missing
