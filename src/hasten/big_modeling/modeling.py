"""Sizes and ties of models whose weights live on several devices: dtypes, module sizes, tied parameters.

Names and results follow ``accelerate.utils.modeling`` (``compute_module_sizes``, ``dtype_byte_size``,
``find_tied_parameters``, ...); finding tied parameters is the weight-file layer's (:mod:`hasten.runtime.weights.tied`,
re-exported here), which checkpoints use too. Moving tensors is in :mod:`hasten.big_modeling.tensors`; device maps
(``infer_auto_device_map`` and friends) are in :mod:`hasten.big_modeling.device_map`.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Mapping

import torch
from torch import nn

from ..errors import ConfigError, did_you_mean
from ..runtime.weights.tied import find_tied_parameters  # noqa: F401 (Accelerate's accelerate.utils.modeling name)
from .tensors import get_module_tensor, get_tensor_owner, integral, named_module_tensors, resolve_dtype

_DTYPE_ALIASES = {
    "fp16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "fp32": torch.float32,
    "float": torch.float32,
    "fp64": torch.float64,
    "double": torch.float64,
}


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """Turn ``"float16"``, ``"torch.bfloat16"``, ``"bf16"`` or a ``torch.dtype`` into a ``torch.dtype``."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    text = str(dtype).strip().lower().removeprefix("torch.")
    if text in _DTYPE_ALIASES:
        return _DTYPE_ALIASES[text]
    candidate = getattr(torch, text, None)
    if isinstance(candidate, torch.dtype):
        return candidate
    known = [name for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype)]
    raise ConfigError(
        f"Unknown dtype {dtype!r}: expected a torch dtype such as 'float16', 'bfloat16' or "
        f"'float32'.{did_you_mean(text, known)}"
    )


def dtype_byte_size(dtype: torch.dtype) -> int | float:
    """Bytes taken by one element of ``dtype``, as Accelerate counts them: the bit width in the dtype's name
    divided by 8 and rounded down (so sub-byte dtypes such as ``torch.int4`` count 0), 1/8 for ``torch.bool``, 1 for
    the float8 dtypes, 1/4 and 1/2 for ``CustomDtype.INT2``/``INT4``.

    Raises:
        ConfigError: (a ``ValueError``) the name of ``dtype`` ends with no bit width.
    """
    from ..enums import CustomDtype

    if dtype == torch.bool:
        return 1 / 8
    if dtype == CustomDtype.INT2:
        return 1 / 4
    if dtype == CustomDtype.INT4:
        return 1 / 2
    if dtype == CustomDtype.FP8 or (isinstance(dtype, torch.dtype) and str(dtype).startswith("torch.float8_")):
        return 1
    bits = re.search(r"\D(\d+)$", str(dtype))
    if bits is None:
        raise ConfigError(
            f"{dtype!r} is not a dtype whose size is known: expected a torch dtype such as torch.float16."
        )
    return int(bits.group(1)) // 8


def compute_module_sizes(
    model: nn.Module,
    dtype: str | torch.dtype | None = None,
    special_dtypes: Mapping[str, str | torch.dtype] | None = None,
    buffers_only: bool = False,
) -> dict[str, int | float]:
    """Size in bytes of every submodule and tensor of ``model``, keyed by dotted name (``""`` is the total).

    A tensor shared by several names (tied weights) is counted once, under the name PyTorch lists first. Sizes
    follow :func:`dtype_byte_size` (a bool tensor of 8 elements is 1 byte, so sizes may be floats), as Accelerate's do.

    Args:
        model: the model (its tensors may be on the meta device).
        dtype: size floating-point tensors as if cast to this dtype, when that is smaller than their own
            (loading never widens them); integer and bool tensors keep their size.
        special_dtypes: ``{tensor_name: dtype}`` overriding ``dtype`` for single tensors.
        buffers_only: count only buffers.
    """
    dtype = resolve_dtype(dtype)
    target = dtype_byte_size(dtype) if dtype is not None else None
    special = {name: dtype_byte_size(resolve_dtype(value)) for name, value in (special_dtypes or {}).items()}
    sizes: dict[str, int | float] = defaultdict(int)
    tensors = model.named_buffers(recurse=True) if buffers_only else named_module_tensors(model, recurse=True)
    for name, tensor in tensors:
        if name in special:
            size = tensor.numel() * special[name]
        elif target is None or integral(tensor.dtype):
            size = tensor.numel() * dtype_byte_size(tensor.dtype)
        else:
            size = tensor.numel() * min(target, dtype_byte_size(tensor.dtype))
        parts = name.split(".")
        for depth in range(len(parts) + 1):
            sizes[".".join(parts[:depth])] += size
    return sizes


def compute_module_total_buffer_size(
    model: nn.Module, dtype: str | torch.dtype | None = None, special_dtypes: Mapping | None = None
) -> int | float:
    """Total bytes of the buffers of ``model`` (see :func:`compute_module_sizes`)."""
    return compute_module_sizes(model, dtype, special_dtypes, buffers_only=True).get("", 0)


def is_unsplittable(obj, no_split_module_classes) -> bool:
    """True for what a device map never splits: a tensor, a module without children, a no-split class."""
    if not isinstance(obj, nn.Module):
        return True
    return not obj._modules or type(obj).__name__ in no_split_module_classes


def get_max_layer_size(modules, module_sizes: Mapping[str, int], no_split_module_classes) -> tuple[int, list[str]]:
    """The largest layer among ``modules``: a layer is a tensor, a module without children or a module whose class is
    in ``no_split_module_classes``; other modules are searched through their children (their own tensors are not
    layers, as in Accelerate).

    Args:
        modules: ``(name, module_or_tensor)`` pairs to search.
        module_sizes: output of :func:`compute_module_sizes` (a name it lacks is added with size 0, as a
            ``defaultdict`` does).
        no_split_module_classes: class names that must stay whole.

    Returns:
        ``(size, names)``: the largest size and the names of the layers that have it.
    """
    best, names = 0, []
    pending = list(modules)
    while pending:
        name, obj = pending.pop(0)
        if is_unsplittable(obj, no_split_module_classes):
            size = module_sizes[name]
            if size > best:
                best, names = size, [name]
            elif size == best:
                names.append(name)
        else:
            pending = [(f"{name}.{child}", module) for child, module in obj.named_children()] + pending
    return best, names


def retie_parameters(model: nn.Module, tied_params: list[list[str]]) -> None:
    """Make each group of names in ``tied_params`` point at one parameter again.

    The first parameter of a group that is not on the meta device is shared with the others (a
    group whose members are all on meta is left as it is).
    """
    for group in tied_params:
        source = None
        for name in group:
            param = get_module_tensor(model, name)
            if param.device.type != "meta":
                source = param
                break
        if source is None:
            continue
        for name in group:
            owner, leaf = get_tensor_owner(model, name)
            owner._parameters[leaf] = source
