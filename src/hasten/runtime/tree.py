"""Tensor utilities on arbitrarily nested structures of tensors: the ground floor under the collectives.

Every function accepts a tensor or a list / tuple / namedtuple / dict (any ``Mapping``, such as a
Transformers ``BatchEncoding``) nesting tensors, and returns the same structure, walking it as Accelerate
does (containers first, then the leaf test), so that the results, including the exception types, are
Accelerate's. hasten's collectives check their inputs with :func:`_require_tensors`, whose ``TypeError``
names the path of the first wrong leaf, e.g. ``batch['labels'][2]``.
Nothing here talks to other processes (the collectives are in :mod:`hasten.runtime.operations`).
"""

from __future__ import annotations

import functools
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import HastenError


class CannotPadNestedTensorWarning(UserWarning):
    """Warned when ``pad_across_processes`` meets a nested tensor, which it returns unpadded."""


class StructureTypeError(HastenError, TypeError):
    """A structure holds a value of a type the operation cannot handle."""


class EmptyStructureError(HastenError, ValueError):
    """An operation needs a value from a structure that is empty."""


class NoBatchDimensionError(HastenError, IndexError):
    """A batch size was asked of a 0-dimensional tensor, or a list of structures was empty."""


class UnpicklableForwardError(HastenError, pickle.PicklingError):
    """A forward wrapped by the fp32 output conversion was pickled."""


@dataclass
class TensorInformation:
    """The shape and dtype of a tensor, without its data."""

    shape: torch.Size
    dtype: torch.dtype


def is_torch_tensor(tensor) -> bool:
    """True for ``torch.Tensor`` instances."""
    return isinstance(tensor, torch.Tensor)


def is_tensor_information(tensor_info) -> bool:
    """Whether ``tensor_info`` is a :class:`TensorInformation`."""
    return isinstance(tensor_info, TensorInformation)


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


def _first_wrong_leaf(data, path: str, test_type):
    if isinstance(data, (tuple, list)):
        items = ((path + f"[{i}]", item) for i, item in enumerate(data))
    elif isinstance(data, Mapping):
        items = ((path + _path_key(k), v) for k, v in data.items())
    elif test_type(data):
        return None
    else:
        return path, data
    for item_path, item in items:
        found = _first_wrong_leaf(item, item_path, test_type)
        if found is not None:
            return found
    return None


def _apply(func, data, test_type, error_on_other_type, args, kwargs):
    if isinstance(data, (tuple, list)):
        return honor_type(data, (_apply(func, item, test_type, error_on_other_type, args, kwargs) for item in data))
    if isinstance(data, Mapping):
        return type(data)({k: _apply(func, v, test_type, error_on_other_type, args, kwargs) for k, v in data.items()})
    if test_type(data):
        return func(data, *args, **kwargs)
    if error_on_other_type:
        name, test = (
            getattr(func, "__name__", type(func).__name__),
            getattr(test_type, "__name__", type(test_type).__name__),
        )
        raise StructureTypeError(
            f"Unsupported types ({type(data)}) passed to `{name}`. Only nested list/tuple/dicts of objects that are "
            f"valid for `{test}` should be passed."
        )
    return data


def recursively_apply(func: Callable, data, *args, test_type=is_torch_tensor, error_on_other_type=False, **kwargs):
    """Apply ``func`` to every leaf of ``data`` that passes ``test_type``, keeping the structure.

    Lists, tuples, namedtuples and mappings are always walked into (rebuilt with their own type); the
    other values are leaves.

    Args:
        func: called as ``func(leaf, *args, **kwargs)``.
        data: a tensor or nested list/tuple/namedtuple/Mapping.
        test_type: predicate selecting the leaves to transform (default: tensors).
        error_on_other_type: raise ``TypeError`` at any other leaf instead of keeping it (Accelerate's message).
    """
    if (
        test_type is is_torch_tensor and not args and not kwargs
    ):  # fast paths: a tensor, a flat tuple/list/dict of tensors
        if isinstance(data, torch.Tensor):
            return func(data)
        kind = type(data)
        if (kind is tuple or kind is list) and all(isinstance(t, torch.Tensor) for t in data):
            return kind([func(t) for t in data])
        if kind is dict and all(isinstance(t, torch.Tensor) for t in data.values()):
            return {k: func(t) for k, t in data.items()}
    return _apply(func, data, test_type, error_on_other_type, args, kwargs)


def _leaves(data, test_type=is_torch_tensor):
    if isinstance(data, (tuple, list)):
        for item in data:
            yield from _leaves(item, test_type)
    elif isinstance(data, Mapping):
        for item in data.values():
            yield from _leaves(item, test_type)
    elif test_type(data):
        yield data


def _require_tensors(data, operation: str = "this operation") -> None:
    """Raise a ``TypeError`` naming the path of the first leaf of ``data`` that is not a tensor (hasten's
    collectives)."""
    if isinstance(data, torch.Tensor) or (
        type(data) in (tuple, list) and all(isinstance(t, torch.Tensor) for t in data)
    ):
        return  # the common case, checked without walking the structure
    found = _first_wrong_leaf(data, "data", is_torch_tensor)
    if found is not None:
        path, leaf = found
        raise StructureTypeError(
            f"{path} is a {type(leaf).__name__} ({leaf!r:.60}), but {operation} needs tensors at every leaf of the "
            "structure (nested lists, tuples, namedtuples and dicts of torch.Tensor). Convert it with torch.as_tensor, "
            "or move it out of the structure."
        )


def send_to_device(tensor, device, non_blocking: bool = False, skip_keys: list[str] | str | None = None):
    """Move every tensor of a nested structure to ``device``.

    Args:
        tensor: the structure; any object with a ``.to`` method (a ``BatchEncoding``, a module) is moved by it,
            as a whole, before containers are walked into.
        device: target device.
        non_blocking: asynchronous copy (effective from pinned memory).
        skip_keys: keys of a mapping whose values stay where they are.
    """
    if isinstance(tensor, torch.Tensor) or hasattr(tensor, "to"):
        try:
            return tensor.to(device, non_blocking=non_blocking)
        except TypeError:  # a .to without non_blocking
            return tensor.to(device)
    if isinstance(tensor, (tuple, list)):
        return honor_type(tensor, (send_to_device(t, device, non_blocking, skip_keys) for t in tensor))
    if isinstance(tensor, Mapping):
        skip = [skip_keys] if isinstance(skip_keys, str) else skip_keys or []
        return type(tensor)(
            {k: t if k in skip else send_to_device(t, device, non_blocking, skip) for k, t in tensor.items()}
        )
    return tensor


def get_data_structure(data):
    """The structure of ``data`` with each tensor replaced by a :class:`TensorInformation` (shape and dtype)."""
    return recursively_apply(lambda t: TensorInformation(shape=t.shape, dtype=t.dtype), data)


def get_shape(data):
    """The structure of ``data`` with each tensor replaced by its shape as a list."""
    return recursively_apply(lambda t: list(t.shape), data)


def initialize_tensors(data_structure):
    """Allocate empty tensors following a structure of :class:`TensorInformation` (see :func:`get_data_structure`)."""
    return recursively_apply(
        lambda info: torch.empty(*info.shape, dtype=info.dtype), data_structure, test_type=is_tensor_information
    )


def find_batch_size(data) -> int:
    """Size of the first dimension of the first tensor of ``data``, following the first item of every container.

    Raises ``ValueError`` when a container on that path is empty, ``TypeError`` when the path ends at a value that
    is not a tensor (later items are not searched) and ``IndexError`` at a 0-dimensional tensor.
    """
    path = "data"
    while isinstance(data, (tuple, list, Mapping)):
        if len(data) == 0:
            raise EmptyStructureError(
                f"Cannot find the batch size: {path} is an empty {type(data).__name__}; give a structure whose first "
                "item holds a tensor."
            )
        key = 0 if isinstance(data, (tuple, list)) else next(iter(data.keys()))
        path, data = path + _path_key(key), data[key]
    if not isinstance(data, torch.Tensor):
        raise StructureTypeError(
            f"Can only find the batch size of tensors, but {path} (the first leaf) is a {type(data).__name__}."
        )
    if data.ndim == 0:
        raise NoBatchDimensionError(
            f"Cannot find the batch size: {path} is a 0-dimensional tensor; a batch needs a first dimension."
        )
    return data.shape[0]


def ignorant_find_batch_size(data) -> int | None:
    """Like :func:`find_batch_size`, but returns None where it raises ``ValueError`` or ``TypeError``."""
    try:
        return find_batch_size(data)
    except (ValueError, TypeError):
        return None


def _to_list(tensor: torch.Tensor):
    tensor = tensor.detach().cpu()
    return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).tolist()


def listify(data):
    """Turn every tensor of ``data`` into (nested) Python lists or numbers (bf16 through fp32)."""
    return recursively_apply(_to_list, data)


def _is_half(value) -> bool:
    return (isinstance(value, torch.Tensor) or hasattr(value, "dtype")) and value.dtype in (
        torch.float16,
        torch.bfloat16,
    )


def _to_fp32(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.float()


def convert_to_fp32(tensor):
    """Cast every fp16/bf16 tensor of a nested structure to fp32."""
    return recursively_apply(_to_fp32, tensor, test_type=_is_half)


class ConvertOutputsToFp32:
    """Wrap a forward function so that its half-precision outputs come back in fp32."""

    def __init__(self, model_forward):
        self.model_forward = model_forward
        functools.update_wrapper(self, model_forward)

    def __call__(self, *args, **kwargs):
        return convert_to_fp32(self.model_forward(*args, **kwargs))

    def __getstate__(self):
        raise UnpicklableForwardError(
            "A model whose forward converts its outputs to fp32 (mixed precision) cannot be pickled; unwrap it first: "
            "accelerator.unwrap_model(model) (or extract_model_from_parallel(model, keep_fp32_wrapper=False))."
        )


def convert_outputs_to_fp32(model_forward):
    """Wrap ``model_forward`` (a model's forward) so that its fp16/bf16 outputs come back in fp32.

    Returns a plain function whose ``__wrapped__`` is the :class:`ConvertOutputsToFp32` wrapper, so that
    ``extract_model_from_parallel(model, keep_fp32_wrapper=False)`` can find ``model._original_forward`` again.
    """
    converting = ConvertOutputsToFp32(model_forward)

    def forward(*args, **kwargs):
        return converting(*args, **kwargs)

    forward.__wrapped__ = converting
    return forward


def find_device(data) -> torch.device | None:
    """Device of the first tensor found in ``data`` (None when there is none)."""
    for leaf in _leaves(data):
        return leaf.device
    return None


def slice_tensors(data, tensor_slice, process_index=None, num_processes=None):
    """Apply ``tensor_slice`` (a ``slice``) to every tensor of ``data``."""
    return recursively_apply(lambda t: t[tensor_slice], data)


def concatenate(data: list, dim: int = 0):
    """Concatenate a list of identically structured nested tensors along ``dim``.

    A list of one structure whose leaf is not a tensor gives that leaf back; other non-tensor leaves raise
    ``TypeError``.
    """
    if isinstance(data, (list, tuple)) and len(data) == 0:
        raise NoBatchDimensionError("concatenate needs a non-empty list of structures to join, got an empty one.")
    first = data[0]
    if isinstance(first, (tuple, list)):
        return honor_type(first, (concatenate([d[i] for d in data], dim=dim) for i in range(len(first))))
    if isinstance(first, Mapping):
        return type(first)({k: concatenate([d[k] for d in data], dim=dim) for k in first.keys()})
    if isinstance(first, torch.Tensor):
        return torch.cat(data, dim=dim)
    if isinstance(data, (tuple, list)) and len(data) == 1:
        return first
    raise StructureTypeError(
        f"concatenate can only join tensors, but got {len(data)} values of type {type(first).__name__} at the same "
        "place."
    )


def _pad_input_tensor(tensor: torch.Tensor, batch_size: int, num_processes: int, dim: int = 0) -> torch.Tensor:
    per_process = batch_size // num_processes
    leftover = batch_size - per_process * num_processes
    to_pad = num_processes - (batch_size if per_process == 0 else per_process)
    if leftover > to_pad and to_pad < 1:
        to_pad = leftover - to_pad
    shape = list(tensor.shape)
    shape[0] = batch_size + to_pad
    padded = tensor.new_zeros(tuple(shape))
    index = [slice(None)] * len(shape)
    index[dim] = slice(0, tensor.shape[dim])
    padded[tuple(index)] = tensor
    return padded


def pad_input_tensors(tensor, batch_size: int, num_processes: int, dim: int = 0):
    """Zero-pad the first dimension of every tensor for ``num_processes`` processes, with Accelerate's sizes.

    The new size is Accelerate's, kept for identical results (``_pad_input_tensor`` spells the rule out: e.g.
    ``num_processes`` rows when ``batch_size < num_processes``); zeros fill the new rows, even when ``batch_size``
    already divides evenly. Every leaf must be a tensor.
    """
    return recursively_apply(
        _pad_input_tensor, tensor, error_on_other_type=True, batch_size=batch_size, num_processes=num_processes, dim=dim
    )
