"""Building blocks for models whose weights live on several devices: tensor placement, sizes, ties.

Names follow ``accelerate.utils.modeling`` (``set_module_tensor_to_device``, ``compute_module_sizes``,
``find_tied_parameters``, ...). Device maps themselves (``infer_auto_device_map`` and friends) are in
:mod:`hasten.big_modeling.device_map`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Mapping

import torch
from torch import nn

from ..errors import ConfigError, NotSupportedError, did_you_mean

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
    raise ConfigError(f"Unknown dtype {dtype!r}: expected a torch dtype such as 'float16', 'bfloat16' or 'float32'.{did_you_mean(text, known)}")


def dtype_byte_size(dtype: str | torch.dtype) -> int:
    """Bytes taken by one element of ``dtype`` in memory.

    Note:
        Accelerate reports 1/8 for ``torch.bool``; hasten reports 1, the byte PyTorch actually uses.
    """
    return parse_dtype(dtype).itemsize


def as_device(device) -> torch.device | str:
    """Normalise a device-map value: an int is an accelerator index, ``"disk"`` stays a string."""
    if isinstance(device, torch.device):
        return device
    if isinstance(device, bool):
        raise ConfigError(f"Invalid device {device!r}: expected an accelerator index, 'cpu', 'disk' or a device string like 'cuda:0'.")
    if isinstance(device, int):
        if device < 0:
            raise ConfigError(f"Invalid device index {device}: accelerator indices start at 0.")
        from ..environment import accelerator_type

        kind = accelerator_type()
        return torch.device("cuda" if kind in ("cpu", "mps") else kind, device)
    if device == "disk":
        return "disk"
    try:
        return torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(
            f"Invalid device {device!r}: expected an accelerator index (0, 1, ...), 'cpu', 'disk', 'meta' or a device "
            "string like 'cuda:0'."
        ) from None


def get_tensor_owner(module: nn.Module, tensor_name: str) -> tuple[nn.Module, str]:
    """The submodule holding ``tensor_name`` (a dotted name) and the tensor's name inside it."""
    *path, leaf = tensor_name.split(".")
    owner = module
    for depth, part in enumerate(path):
        child = owner._modules.get(part)
        if child is None:
            where = ".".join(path[:depth]) or "the model"
            raise ConfigError(
                f"Cannot find {tensor_name!r}: {where} ({type(owner).__name__}) has no submodule {part!r}."
                f"{did_you_mean(part, list(owner._modules))}"
            )
        owner = child
    return owner, leaf


def get_module_tensor(module: nn.Module, tensor_name: str) -> torch.Tensor:
    """The parameter or buffer called ``tensor_name`` (a dotted name) in ``module``."""
    owner, leaf = get_tensor_owner(module, tensor_name)
    if leaf in owner._parameters and owner._parameters[leaf] is not None:
        return owner._parameters[leaf]
    if leaf in owner._buffers and owner._buffers[leaf] is not None:
        return owner._buffers[leaf]
    choices = [*owner._parameters, *owner._buffers]
    raise ConfigError(
        f"{type(owner).__name__} has no parameter or buffer named {leaf!r} (looking for {tensor_name!r}).{did_you_mean(leaf, choices)}"
    )


def get_non_persistent_buffers(module: nn.Module, recurse: bool = False, fqns: bool = False) -> set[str]:
    """Names of the buffers of ``module`` that are not saved in its state dict.

    With ``recurse`` the submodules' buffers count too; their names are dotted paths from ``module`` with
    ``fqns``, bare buffer names without (Accelerate's behaviour).
    """
    if not recurse:
        return set(module._non_persistent_buffers_set)
    names = set()
    for prefix, submodule in module.named_modules():
        names |= {f"{prefix}.{name}" if prefix and fqns else name for name in submodule._non_persistent_buffers_set}
    return names


def named_module_tensors(
    module: nn.Module, include_buffers: bool = True, recurse: bool = False, remove_non_persistent: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for the parameters, then (optionally) the buffers, of ``module``.

    Args:
        module: the module.
        include_buffers: also yield buffers.
        recurse: include the submodules' tensors (names are dotted).
        remove_non_persistent: skip buffers that are not part of the state dict.
    """
    yield from module.named_parameters(recurse=recurse)
    if include_buffers:
        skip = get_non_persistent_buffers(module, recurse=recurse, fqns=True) if remove_non_persistent else set()
        for name, buffer in module.named_buffers(recurse=recurse):
            if name not in skip:
                yield name, buffer


def moved_parameter(old: nn.Parameter, new: torch.Tensor) -> nn.Parameter:
    """A parameter of the same class as ``old`` (with its attributes) holding ``new``."""
    requires_grad = old.requires_grad and (new.is_floating_point() or new.is_complex())
    param = type(old)(new, requires_grad=requires_grad)
    param.__dict__.update(old.__dict__)
    return param


def _prepare_value(tensor_name: str, old: torch.Tensor, value, dtype: torch.dtype | None) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        value = torch.tensor(value)
    if old.shape != value.shape:
        raise ConfigError(
            f"Cannot set {tensor_name!r}: the new value has shape {tuple(value.shape)} but the tensor has shape "
            f"{tuple(old.shape)}. Check that the checkpoint matches this model's configuration."
        )
    if dtype is None:
        return value.to(old.dtype)
    if value.is_floating_point():
        return value.to(dtype)
    return value


def set_module_tensor_to_device(
    module: nn.Module,
    tensor_name: str,
    device,
    value: torch.Tensor | None = None,
    dtype: str | torch.dtype | None = None,
    fp16_statistics: torch.Tensor | None = None,
    tied_params_map: dict | None = None,
    non_blocking: bool = False,
    clear_cache: bool = True,
) -> None:
    """Put the parameter or buffer ``tensor_name`` of ``module`` on ``device``, optionally with a new value.

    Works for tensors on the meta device (pass ``value``) and moves them to ``"meta"`` as well.

    Args:
        module: the model (or any module holding the tensor).
        tensor_name: dotted name, e.g. ``"encoder.layer.0.weight"``.
        device: an index, ``"cpu"``, ``"meta"``, ``"cuda:1"`` or a ``torch.device``.
        value: new contents; its shape must match. Without ``dtype`` it is cast to the tensor's current dtype.
        dtype: cast floating-point values to this dtype instead.
        fp16_statistics: bitsandbytes 8-bit statistics; accepted for compatibility, not supported.
        tied_params_map: ``{data_ptr: {device: tensor}}`` of tied weights already placed; a value found
            there is reused instead of copied again (and new placements are recorded).
        non_blocking: asynchronous copy.
        clear_cache: after a tensor leaves an accelerator, return the freed memory to the device
            (a synchronisation; hasten's own loaders pass False).

    Raises:
        ConfigError: unknown tensor, shape mismatch, or a meta tensor moved to a real device without ``value``.
    """
    if fp16_statistics is not None:
        raise NotSupportedError("fp16_statistics (bitsandbytes 8-bit weights) is not supported by hasten.")
    owner, leaf = get_tensor_owner(module, tensor_name)
    old = get_module_tensor(owner, leaf)
    is_buffer = leaf in owner._buffers
    device = as_device(device)
    if device == "disk":
        raise ConfigError(f"Cannot put {tensor_name!r} on 'disk' directly; offload it with hasten.utils.offload_state_dict.")
    key = value.data_ptr() if isinstance(value, torch.Tensor) and tied_params_map is not None else None
    if key is not None and device in tied_params_map.get(key, {}):
        store = owner._buffers if is_buffer else owner._parameters
        store[leaf] = tied_params_map[key][device]
        return
    if value is None and old.device.type == "meta" and device.type != "meta":
        raise ConfigError(
            f"{tensor_name!r} is on the meta device and has no data to move to {device}: pass value=... "
            "or load a checkpoint (hasten.load_checkpoint_in_model) first."
        )
    dtype = parse_dtype(dtype)
    if value is None and old.device == device and (dtype is None or dtype == old.dtype or not old.is_floating_point()):
        return
    with torch.no_grad():
        if value is None:
            new = old.to(device, non_blocking=non_blocking)
            if dtype is not None and new.is_floating_point():
                new = new.to(dtype)
        else:
            new = _prepare_value(tensor_name, old, value, dtype).to(device, non_blocking=non_blocking)
    if is_buffer:
        owner._buffers[leaf] = new
    else:
        owner._parameters[leaf] = moved_parameter(old, new)
    if key is not None and key in tied_params_map:
        tied_params_map[key][device] = owner._buffers[leaf] if is_buffer else owner._parameters[leaf]
    if clear_cache and old.device.type in ("cuda", "xpu") and device != old.device:
        backend = old.device.type
        del old
        getattr(torch, backend).empty_cache()


def tensor_size(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> int:
    """Bytes ``tensor`` takes once floating-point tensors are cast to ``dtype`` (integers keep their own)."""
    itemsize = dtype.itemsize if dtype is not None and tensor.is_floating_point() else tensor.dtype.itemsize
    return tensor.numel() * itemsize


def _tensor_bytes(name: str, tensor: torch.Tensor, dtype, special_dtypes: Mapping) -> int:
    if name in special_dtypes:
        return tensor.numel() * parse_dtype(special_dtypes[name]).itemsize
    return tensor_size(tensor, dtype)


def compute_module_sizes(
    model: nn.Module,
    dtype: str | torch.dtype | None = None,
    special_dtypes: Mapping[str, str | torch.dtype] | None = None,
    buffers_only: bool = False,
) -> dict[str, int]:
    """Size in bytes of every submodule and tensor of ``model``, keyed by dotted name (``""`` is the total).

    A tensor shared by several names (tied weights) is counted once, under the name PyTorch lists first.

    Args:
        model: the model (its tensors may be on the meta device).
        dtype: size floating-point tensors as if cast to this dtype.
        special_dtypes: ``{tensor_name: dtype}`` overriding ``dtype`` for single tensors.
        buffers_only: count only buffers.
    """
    dtype = parse_dtype(dtype)
    special = dict(special_dtypes or {})
    sizes: dict[str, int] = defaultdict(int)
    tensors = model.named_buffers() if buffers_only else named_module_tensors(model, recurse=True)
    for name, tensor in tensors:
        size = _tensor_bytes(name, tensor, dtype, special)
        parts = name.split(".")
        for depth in range(len(parts) + 1):
            sizes[".".join(parts[:depth])] += size
    return sizes


def compute_module_total_buffer_size(
    model: nn.Module, dtype: str | torch.dtype | None = None, special_dtypes: Mapping | None = None
) -> int:
    """Total bytes of the buffers of ``model``."""
    return compute_module_sizes(model, dtype, special_dtypes, buffers_only=True).get("", 0)


def module_parts(module: nn.Module, prefix: str) -> list[tuple[str, nn.Module | torch.Tensor]]:
    """What ``module`` splits into: its own parameters, its children, then its own buffers (dotted names)."""
    join = (lambda name: f"{prefix}.{name}") if prefix else (lambda name: name)
    return (
        [(join(name), tensor) for name, tensor in module.named_parameters(recurse=False)]
        + [(join(name), child) for name, child in module.named_children()]
        + [(join(name), tensor) for name, tensor in module.named_buffers(recurse=False)]
    )


def is_atomic(obj, no_split_module_classes) -> bool:
    """True for what a device map never splits: a tensor, a module without children, a no-split class."""
    if not isinstance(obj, nn.Module):
        return True
    return not obj._modules or type(obj).__name__ in no_split_module_classes


def get_max_layer_size(modules, module_sizes: Mapping[str, int], no_split_module_classes) -> tuple[int, list[str]]:
    """The largest unit a device map cannot split, among ``modules`` and everything under them.

    Args:
        modules: ``(name, module_or_tensor)`` pairs to search.
        module_sizes: output of :func:`compute_module_sizes`.
        no_split_module_classes: class names that must stay whole.

    Returns:
        ``(size, names)``: the largest size and the names of the units that have it.
    """
    no_split = set(no_split_module_classes or ())
    best, names = 0, []
    pending = list(modules)
    while pending:
        name, obj = pending.pop(0)
        if is_atomic(obj, no_split):
            size = module_sizes.get(name, 0)
            if size > best:
                best, names = size, [name]
            elif size == best:
                names.append(name)
        else:
            pending = module_parts(obj, name) + pending
    return best, names


def find_tied_parameters(model: nn.Module) -> list[list[str]]:
    """Groups of parameter names that refer to the same parameter object (tied weights).

    Works on the meta device, since ties are found by identity. Each group is sorted.

    Example:
        >>> find_tied_parameters(model)   # a language model whose output layer reuses the embedding
        [['lm_head.weight', 'transformer.wte.weight']]
    """
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return [sorted(names) for names in groups.values() if len(names) > 1]


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
