"""Where a model's tensors live: finding a tensor by its dotted name, and moving or replacing it on a device.

Names follow ``accelerate.utils.modeling`` (``set_module_tensor_to_device``, ``named_module_tensors``, ...), and so
do the results: the dtype a value ends in, which parameter objects are replaced, what tied weights share.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from ..errors import ConfigError, NotSupportedError, did_you_mean


class DtypeNameError(ConfigError, AttributeError):
    """A dtype given by a name torch does not have (Accelerate's ``getattr(torch, name)`` raises AttributeError)."""


class TensorNameError(ConfigError, AttributeError):
    """A dotted tensor name whose path goes through a submodule the model does not have."""


class ValueTypeError(ConfigError, AttributeError):
    """A value that is not a tensor given where a tensor is set (Accelerate fails reading its ``.shape``)."""


class NoDeviceError(ConfigError, TypeError):
    """A parameter set to ``device=None`` (Accelerate fails building ``torch.device(None)``)."""


def resolve_dtype(dtype):
    """A dtype argument as Accelerate reads it: ``"float16"`` or ``"torch.float16"`` become ``torch.float16``.

    Any other value (a ``torch.dtype``, None) is returned as it is.

    Raises:
        DtypeNameError: (an ``AttributeError`` and ``ValueError``) torch has no attribute of that name.
    """
    if not isinstance(dtype, str):
        return dtype
    name = dtype.replace("torch.", "")
    if not hasattr(torch, name):
        known = [n for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype)]
        raise DtypeNameError(
            f"Unknown dtype {dtype!r}: expected the name of a torch dtype such as 'float16', 'bfloat16' or "
            f"'torch.float32'.{did_you_mean(name, known)}"
        )
    return getattr(torch, name)


def as_device(device) -> torch.device | str:
    """Normalise a device-map value: an int is an accelerator index, ``"disk"`` stays a string."""
    if isinstance(device, torch.device):
        return device
    if isinstance(device, bool):
        raise ConfigError(
            f"Invalid device {device!r}: expected an accelerator index, 'cpu', 'disk' or a device string like 'cuda:0'."
        )
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
    """The submodule holding ``tensor_name`` (a dotted name) and the tensor's name inside it.

    Raises:
        TensorNameError: (an ``AttributeError``, as Accelerate's ``getattr`` raises) a submodule of the path is
            missing.
    """
    *path, leaf = tensor_name.split(".")
    owner = module
    for depth, part in enumerate(path):
        child = owner._modules.get(part)
        if child is None:
            where = ".".join(path[:depth]) or "the model"
            raise TensorNameError(
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
        f"{type(owner).__name__} has no parameter or buffer named {leaf!r} (looking for {tensor_name!r})."
        f"{did_you_mean(leaf, choices)}"
    )


def get_non_persistent_buffers(module: nn.Module, recurse: bool = False, fqns: bool = False) -> set[str]:
    """Names of the buffers of ``module`` that are not saved in its state dict (Accelerate's answer, to the name).

    ``module``'s own come by bare name. With ``recurse`` every submodule's come too: by bare name, or with
    ``fqns`` as ``<submodule path>.<name>`` (``module``'s own then appear a second time as ``.<name>``).
    """
    names = set(module._non_persistent_buffers_set)
    if recurse:
        for prefix, submodule in module.named_modules():
            names |= (
                {f"{prefix}.{name}" for name in submodule._non_persistent_buffers_set}
                if fqns
                else set(submodule._non_persistent_buffers_set)
            )
    return names


def named_module_tensors(
    module: nn.Module, include_buffers: bool = True, recurse: bool = False, remove_non_persistent: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for the parameters, then (optionally) the buffers, of ``module``.

    Args:
        module: the module.
        include_buffers: also yield buffers.
        recurse: include the submodules' tensors (names are dotted).
        remove_non_persistent: skip the buffers whose name is the bare name of a non-persistent buffer of
            ``module`` (or, with ``recurse``, of any submodule): with ``recurse`` a submodule's dotted buffer
            names are therefore kept, as in Accelerate.
    """
    yield from module.named_parameters(recurse=recurse)
    if include_buffers:
        skip = get_non_persistent_buffers(module, recurse=recurse) if remove_non_persistent else set()
        for name, buffer in module.named_buffers(recurse=recurse):
            if name not in skip:
                yield name, buffer


def moved_parameter(old: nn.Parameter, new: torch.Tensor) -> nn.Parameter:
    """A parameter of the same class as ``old`` holding ``new``, as Accelerate builds one: ``requires_grad`` and
    transformers' ``_is_hf_initialized`` mark are kept, other attributes of ``old`` are not."""
    param = type(old)(new, requires_grad=old.requires_grad)
    marked = old.__dict__.get("_is_hf_initialized")
    if marked is not None:
        param._is_hf_initialized = marked
    return param


def integral(dtype: torch.dtype) -> bool:
    """Integer and bool dtypes, which a ``dtype=`` never casts."""
    return str(dtype).startswith(("torch.uint", "torch.int", "torch.bool"))


def same_device(first: torch.device, second: torch.device) -> bool:
    """Whether two devices are one, an accelerator without index meaning index 0 (``cpu`` and ``cpu:0`` differ)."""
    if first.type != second.type:
        return False
    if first.type != "cpu" and first.index is None:
        first = torch.device(first.type, 0)
    if second.type != "cpu" and second.index is None:
        second = torch.device(second.type, 0)
    return first == second


def _tensor_target(module: nn.Module, tensor_name: str) -> tuple[nn.Module, str, torch.Tensor]:
    owner, leaf = get_tensor_owner(module, tensor_name)
    if leaf not in owner._parameters and leaf not in owner._buffers:
        raise ConfigError(
            f"{type(owner).__name__} has no parameter or buffer named {leaf!r} (looking for {tensor_name!r})."
            f"{did_you_mean(leaf, [*owner._parameters, *owner._buffers])}"
        )
    return owner, leaf, getattr(owner, leaf)


def _placed_tie(old: torch.Tensor, value, device, tied_params_map):
    """A tied weight already placed on ``device`` for ``value`` (or, without a match, for ``old``), or None."""
    if tied_params_map is None:
        return None
    for source in (value, old):
        if source is not None and source.data_ptr() in tied_params_map and device in tied_params_map[source.data_ptr()]:
            return tied_params_map[source.data_ptr()][device]
    return None


def _record_tie(tied_params_map, old: torch.Tensor, value, device, new: torch.Tensor) -> None:
    if tied_params_map is None:
        return
    for source in (old, value):
        if (
            source is not None
            and source.data_ptr() in tied_params_map
            and device not in tied_params_map[source.data_ptr()]
        ):
            tied_params_map[source.data_ptr()][device] = new
            return


def _checked_value(tensor_name: str, old: torch.Tensor, value, dtype, non_blocking: bool) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ValueTypeError(f"Cannot set {tensor_name!r} from a {type(value).__name__}: pass a torch.Tensor as value.")
    if old.shape != value.shape:
        # The message is Accelerate's word for word: callers compare it as text.
        short_name = tensor_name.rsplit(".", 1)[-1]
        raise ConfigError(
            f'Trying to set a tensor of shape {value.shape} in "{short_name}" (which has shape {old.shape}), '
            "this looks incorrect."
        )
    if dtype is None:
        return value.to(old.dtype, non_blocking=non_blocking)
    return value if integral(value.dtype) else value.to(dtype, non_blocking=non_blocking)


def _target_device(device):
    """``device`` as ``Tensor.to`` takes it: an int is an accelerator index of this machine's kind."""
    if isinstance(device, int) and not isinstance(device, bool):
        return as_device(device)
    return device


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

    Accelerate's rules: ``value`` is cast to the tensor's current dtype, or to ``dtype`` when given (integer and
    bool values keep theirs); without ``value``, ``dtype`` applies only when moving to ``"meta"``. A parameter is
    replaced by a new one of its class (``requires_grad`` kept) when it gets a value or changes device.

    Args:
        module: the model (or any module holding the tensor).
        tensor_name: dotted name, e.g. ``"encoder.layer.0.weight"``.
        device: an index, ``"cpu"``, ``"meta"``, ``"cuda:1"`` or a ``torch.device``.
        value: new contents (a tensor); its shape must match.
        dtype: the dtype to give ``value``: a ``torch.dtype`` or its name (``"float16"``, ``"torch.bfloat16"``;
            Accelerate takes a name for a device there and fails).
        fp16_statistics: bitsandbytes 8-bit statistics; accepted for compatibility, not supported.
        tied_params_map: ``{data_ptr: {device: tensor}}`` of tied weights already placed; a value found
            there is reused instead of copied again (and new placements are recorded).
        non_blocking: asynchronous copy.
        clear_cache: after moving a tensor to an accelerator, return the cached memory to it (a synchronisation).

    Raises:
        ConfigError: (a ``ValueError``) unknown tensor, shape mismatch, or a meta tensor moved to a real device
            without ``value``; a missing submodule on the path is a :class:`TensorNameError` (an ``AttributeError``).
    """
    if fp16_statistics is not None:
        raise NotSupportedError("fp16_statistics (bitsandbytes 8-bit weights) is not supported by hasten.")
    dtype = resolve_dtype(dtype)
    owner, leaf, old = _tensor_target(module, tensor_name)
    is_buffer = leaf in owner._buffers
    placed = _placed_tie(old, value, device, tied_params_map)
    if placed is not None:
        owner._parameters[leaf] = placed
        return
    if old.device.type == "meta" and device not in ("meta", torch.device("meta")) and value is None:
        raise ConfigError(
            f"{tensor_name!r} is on the meta device and has no data to move to {device}: pass value=... "
            "or load a checkpoint (hasten.load_checkpoint_in_model) first."
        )
    if value is not None:
        value = _checked_value(tensor_name, old, value, dtype, non_blocking)
    if device is None and not is_buffer:
        raise NoDeviceError(
            f"Cannot put the parameter {tensor_name!r} on device None: pass a device (e.g. an AlignDevicesHook that "
            "offloads needs an execution_device to bring its weights to for the forward)."
        )
    target = _target_device(device)
    with torch.no_grad():
        if value is None:
            new = old.to(target, non_blocking=non_blocking)
            if dtype is not None and device in ("meta", torch.device("meta")):
                if not integral(old.dtype):
                    new = new.to(dtype, non_blocking=non_blocking)
                if not is_buffer:
                    owner._parameters[leaf] = type(owner._parameters[leaf])(new, requires_grad=old.requires_grad)
        else:
            new = value.to(target, non_blocking=non_blocking)
        if is_buffer:
            owner._buffers[leaf] = new
        elif value is not None or not same_device(torch.device(target), owner._parameters[leaf].device):
            owner._parameters[leaf] = moved_parameter(owner._parameters[leaf], new).to(
                target, non_blocking=non_blocking
            )
    if clear_cache and device not in ("cpu", "meta"):
        from ..runtime.memory import clear_device_cache

        clear_device_cache()
    _record_tie(tied_params_map, old, value, device, new)
