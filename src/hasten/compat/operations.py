"""The less used tensor helpers of ``accelerate.utils.operations``: dtype codes, sending a tensor
that only one process has, the debug-check decorators and DeepSpeed's parameter gathering.

hasten's own collectives (:mod:`hasten.runtime.operations`) already verify themselves in debug mode; these helpers exist
for code written against Accelerate's API.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist

from ..errors import DistributedOperationException

TENSOR_TYPE_TO_INT = {
    torch.float: 1, torch.double: 2, torch.half: 3, torch.bfloat16: 4, torch.uint8: 5, torch.int8: 6, torch.int16: 7,
    torch.int32: 8, torch.int64: 9, torch.bool: 10,
}  # fmt: skip
TENSOR_INT_TO_DTYPE = {code: dtype for dtype, code in TENSOR_TYPE_TO_INT.items()}


def is_torch_xpu_tensor(tensor) -> bool:
    """Whether ``tensor`` is a tensor on an Intel XPU."""
    return isinstance(tensor, torch.Tensor) and tensor.device.type == "xpu"


def _multi_process() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def gather_tensor_shape(tensor) -> tuple[torch.Size, torch.dtype] | None:
    """The shape and dtype of the tensor that one process holds (the others pass ``None``), on every process.

    Returns ``None`` when no process holds a tensor. A collective: every process must call it.
    """
    mine = None if tensor is None else (tuple(tensor.shape), TENSOR_TYPE_TO_INT.get(tensor.dtype, 0), str(tensor.dtype))
    if not _multi_process():
        everyone = [mine]
    else:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    held = [(rank, info) for rank, info in enumerate(everyone) if info is not None]
    if len(held) > 1:
        raise DistributedOperationException(
            f"gather_tensor_shape: processes {[rank for rank, _ in held]} all passed a tensor; exactly one process may "
            "hold it and the others must pass None."
        )
    if not held:
        return None
    shape, code, name = held[0][1]
    if code not in TENSOR_INT_TO_DTYPE:
        raise DistributedOperationException(
            f"gather_tensor_shape: dtype {name} cannot be sent; use one of {sorted(map(str, TENSOR_TYPE_TO_INT))}."
        )
    return torch.Size(shape), TENSOR_INT_TO_DTYPE[code]


def copy_tensor_to_devices(tensor=None) -> torch.Tensor:
    """Send the tensor that exactly one process holds to every process (the others pass ``None``).

    Unlike :func:`~hasten.runtime.operations.broadcast`, the receivers need not know the shape or dtype. A collective.
    """
    found = gather_tensor_shape(tensor)
    if found is None:
        raise DistributedOperationException("copy_tensor_to_devices: no process passed a tensor; exactly one must.")
    if not _multi_process():
        return tensor
    from ..state import PartialState

    shape, dtype = found
    owner = [None] * dist.get_world_size()
    dist.all_gather_object(owner, tensor is not None)
    source = owner.index(True)
    device = PartialState().device
    buffer = tensor.to(device) if tensor is not None else torch.empty(shape, dtype=dtype, device=device)
    dist.broadcast(buffer, src=source)
    return buffer


def verify_operation(function):
    """Decorator: in debug mode, check that every process calls ``function`` with tensors of the same shapes first
    (raising :class:`~hasten.errors.DistributedOperationException` listing them), as hasten's collectives do."""
    from ..runtime.operations import _collective

    return _collective(function.__name__)(function)


def chained_operation(function):
    """Decorator: a :class:`~hasten.errors.DistributedOperationException` raised inside ``function`` is re-raised
    naming ``function`` as the operation that failed."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except DistributedOperationException as error:
            operation = f"{function.__module__}.{function.__name__}"
            raise DistributedOperationException(f"Error found while calling `{operation}`: {error}") from error

    return wrapper


def GatheredParameters(params, modifier_rank=None, fwd_module=None, enabled=True):
    """Context manager gathering DeepSpeed ZeRO-3 partitioned ``params`` for the duration of the block.

    When the parameters are not ZeRO-3 partitioned (any other engine) it does nothing, so the same code runs
    everywhere. The arguments are DeepSpeed's ``deepspeed.zero.GatheredParameters``'.
    """
    listed = [params] if isinstance(params, torch.nn.Parameter) else list(params) if params is not None else []
    if not enabled or not any(hasattr(p, "ds_id") for p in listed):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(
        listed, modifier_rank=modifier_rank, fwd_module=fwd_module, enabled=enabled
    )
