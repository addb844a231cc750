"""Collectives on arbitrarily nested structures of tensors (the structure helpers are in :mod:`hasten.runtime.tree`).

Every collective accepts a tensor or a list / tuple / namedtuple / dict (any ``Mapping``) nesting tensors,
and returns the same structure.

On a single process the collectives return their input (``gather``/``reduce`` return copies).
In every mode a collective that does not complete within ``HASTEN_HANG_TIMEOUT`` ends the job with a
report (see :mod:`hasten.runtime.hang_watchdog`). In debug mode (``HASTEN_DEBUG_MODE=1``, ``hasten launch
--debug``) each collective first checks that every rank calls the same operation with compatible
shapes (see :mod:`hasten.runtime.debug_mode`).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch
import torch.distributed as dist

from . import debug_mode, hang_watchdog
from .tree import CannotPadNestedTensorWarning, StructureTypeError, _require_tensors, recursively_apply
from ..errors import DistributedOperationException  # noqa: F401  (re-exported for compatibility)


# ------------------------------------------------------------------------------------ structures


# ----------------------------------------------------------------------------------- collectives


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def _collective(name: str):
    """Mark a public collective: the hang watchdog records it, and debug mode first verifies the inputs."""

    def decorate(function):
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            if _world()[0] == 1:  # one process has nothing to wait for
                return function(*args, **kwargs)
            hang_watchdog.enter(name)
            try:
                if debug_mode.active():
                    debug_mode.check(name, args, kwargs)
                return function(*args, **kwargs)
            finally:
                hang_watchdog.leave()

        return wrapper

    return decorate


def barrier() -> None:
    """Block until every process reaches this point (monitored in debug mode)."""
    _barrier()


@_collective("wait_for_everyone")
def _barrier() -> None:
    if _world()[0] > 1:
        dist.barrier()


def _gather_one(tensor: torch.Tensor) -> torch.Tensor:
    world, _ = _world()
    if tensor.ndim == 0:
        tensor = tensor[None]
    tensor = tensor.contiguous()
    if dist.get_backend() == "nccl":
        out = torch.empty((world * tensor.shape[0],) + tuple(tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
        dist.all_gather_into_tensor(out, tensor)
        return out
    parts = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(parts, tensor)
    return torch.cat(parts, dim=0)


@_collective("gather")
def gather(tensor):
    """Gather tensors from every process and concatenate them on the first dimension.

    0-dimensional tensors become 1-dimensional. Every process gets the result. On one process ``tensor``
    comes back as it is (the same object, unchecked), as in Accelerate.
    """
    if _world()[0] == 1:
        return tensor
    _require_tensors(tensor, "gather")
    return recursively_apply(_gather_one, tensor)


@_collective("gather_object")
def gather_object(object: Any):
    """Gather picklable objects from every process: the items of each process's list (or other iterable), in rank order.

    As in Accelerate, each process's object is iterated (a list gives its items, a dict its keys), and on one
    process ``object`` comes back as it is.
    """
    world, _ = _world()
    if world == 1:
        return object
    output: list = [None] * world
    dist.all_gather_object(output, object)
    try:
        return [item for part in output for item in part]
    except TypeError:
        kinds = sorted({type(part).__name__ for part in output})
        raise StructureTypeError(
            f"gather_object joins the lists of every process, but got {', '.join(kinds)}: wrap the object in a list, "
            "gather_object([obj]), to get one item per process."
        ) from None


@_collective("broadcast")
def broadcast(tensor, from_process: int = 0):
    """Copy every tensor of ``tensor`` from process ``from_process`` to all others, in place; returns it."""
    if _world()[0] == 1:
        return tensor
    _require_tensors(tensor, "broadcast")

    def _one(t):
        dist.broadcast(t, src=from_process)
        return t

    return recursively_apply(_one, tensor)


@_collective("broadcast_object_list")
def broadcast_object_list(object_list: list, from_process: int = 0) -> list:
    """Replace the items of ``object_list`` in place with those of process ``from_process``; returns it."""
    if _world()[0] > 1:
        dist.broadcast_object_list(object_list, src=from_process)
    return object_list


_REDUCE_OPS = {"sum": "SUM", "mean": "SUM", "max": "MAX", "min": "MIN"}


@_collective("reduce")
def reduce(tensor, reduction: str = "mean", scale: float = 1.0):
    """All-reduce every tensor of ``tensor`` across processes; returns new tensors.

    Args:
        reduction: ``"mean"`` (default here; ``Accelerator.reduce`` defaults to ``"sum"``), ``"sum"``,
            ``"max"``, ``"min"`` or ``"none"`` (a copy, unreduced).
        scale: multiply the result by this factor.
    """
    if reduction not in (*_REDUCE_OPS, "none"):
        raise ValueError(f"reduce(reduction={reduction!r}): choose one of 'sum', 'mean', 'max', 'min', 'none'.")
    _require_tensors(tensor, "reduce")
    world, _ = _world()

    def _one(t):
        out = t.clone()
        if world > 1 and reduction != "none":
            dist.all_reduce(out, op=getattr(dist.ReduceOp, _REDUCE_OPS[reduction]))
            if reduction == "mean":
                out /= world
        if scale != 1.0:
            out *= scale
        return out

    return recursively_apply(_one, tensor)


def _pad_one(tensor: torch.Tensor, dim: int, pad_index, pad_first: bool, sizes: list[int] | None = None) -> torch.Tensor:
    if dim < 0:
        dim += tensor.ndim
    if sizes is None:
        size = torch.tensor([tensor.shape[dim]], device=tensor.device)
        sizes = _gather_one(size).tolist()
    max_size = max(sizes)
    if max_size == tensor.shape[dim]:
        return tensor
    new_shape = list(tensor.shape)
    new_shape[dim] = max_size
    out = tensor.new_full(new_shape, pad_index)
    index = [slice(None)] * tensor.ndim
    index[dim] = slice(max_size - tensor.shape[dim], max_size) if pad_first else slice(0, tensor.shape[dim])
    out[tuple(index)] = tensor
    return out


@_collective("pad_across_processes")
def pad_across_processes(tensor, dim: int = 0, pad_index: int = 0, pad_first: bool = False):
    """Pad every tensor to the largest size of dimension ``dim`` across processes, so it can be gathered.

    As in Accelerate, the structure is rebuilt (a tensor already of the largest size comes back as it is),
    a tensor with fewer than ``dim`` dimensions is left as it is, a nested tensor is returned unpadded with a
    :class:`CannotPadNestedTensorWarning`, and the padded tensor has the dtype of ``tensor + pad_index``.

    Args:
        dim: the dimension to pad.
        pad_index: the value used for padding.
        pad_first: pad at the beginning instead of the end.
    """
    _require_tensors(tensor, "pad_across_processes")
    return recursively_apply(_pad_to_largest, tensor, dim=dim, pad_index=pad_index, pad_first=pad_first)


def _pad_to_largest(tensor: torch.Tensor, dim: int, pad_index, pad_first: bool) -> torch.Tensor:
    if tensor.is_nested:
        warnings.warn("pad_across_processes cannot pad a nested tensor; it is returned as it is.", CannotPadNestedTensorWarning, stacklevel=4)
        return tensor
    if dim >= tensor.ndim or dim < -tensor.ndim:
        return tensor
    dim = dim % tensor.ndim
    size = tensor.shape[dim]
    largest = size if _world()[0] == 1 else max(_gather_one(torch.tensor([size], device=tensor.device)).tolist())
    if largest == size:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = largest
    padded = tensor.new_zeros(shape) + pad_index
    index = [slice(None)] * tensor.ndim
    index[dim] = slice(largest - size, largest) if pad_first else slice(0, size)
    padded[tuple(index)] = tensor
    return padded


def gather_with_sizes(tensor, sizes: list[int]):
    """Gather tensors whose first dimension differs between processes, given every process's size.

    Used by ``gather_for_metrics`` on uneven last batches, where every rank knows all sizes, so no
    extra collective is needed to exchange them. Returns the concatenation without any padding.
    """

    def _one(t):
        padded = _pad_one(t, 0, 0, False, sizes)
        full = _gather_one(padded)
        step = max(sizes)
        return torch.cat([full[i * step : i * step + n] for i, n in enumerate(sizes)], dim=0)

    return recursively_apply(_one, tensor)


