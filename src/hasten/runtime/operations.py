"""Collectives on arbitrarily nested structures of tensors (the structure helpers are in :mod:`hasten.runtime.tree`).

Every collective accepts a tensor or a list / tuple / namedtuple / dict (any ``Mapping``) nesting tensors,
and returns the same structure.

On a single process the collectives return their input (``gather``/``reduce`` return copies).
In every mode each collective first checks that every process runs the same operation on inputs that fit
(shapes, dtypes, arguments), and raises on every process instead of returning a wrong tensor (see
:mod:`hasten.runtime.collective_check`); a collective that does not complete within ``HASTEN_HANG_TIMEOUT``
ends the job with a report, and one whose peer is gone names where that peer stopped (see
:mod:`hasten.runtime.hang_watchdog`).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..errors import DistributedOperationException, HastenError
from . import collective_check, debug_mode, hang_watchdog
from .memory import should_reduce_batch_size
from .tree import CannotPadNestedTensorWarning, StructureTypeError, _leaves, _require_tensors, recursively_apply

# ------------------------------------------------------------------------------------ structures


# ----------------------------------------------------------------------------------- collectives


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def _no_inputs(*args, **kwargs) -> None:
    """What must agree for a collective whose inputs may differ between processes: nothing but the operation."""


def _first_argument_shapes(*args, **kwargs):
    return collective_check.same_tensors(args[0]) if args else None


def _collective(name: str, agree: Callable | None = None):
    """Mark a public collective: the hang watchdog records it, every process first checks that all of them run it
    on inputs that fit (``agree(*args, **kwargs)`` returns what must be equal across processes), and a failure to
    communicate names where the other processes are.

    Without ``agree`` (functions users decorate with ``verify_operation``) the check runs in debug mode only, on
    the shapes of the first argument, as Accelerate's does. The decorated function's ``agreed`` attribute runs it
    without the check, for hasten's own callers whose processes agree by construction (the dispatcher's
    per-batch broadcasts, whose receivers allocate from the shapes the sender sent): no extra collective per step.
    """

    def decorate(function):
        def run(check: Callable | None, args: tuple, kwargs: dict):
            if _world()[0] == 1:  # one process has nothing to wait for
                return function(*args, **kwargs)
            seq = hang_watchdog.enter(name)
            try:
                if check is not None:
                    collective_check.verify(name, seq, check, args, kwargs)
                return function(*args, **kwargs)
            except RuntimeError as error:
                if isinstance(error, HastenError) or should_reduce_batch_size(error):
                    raise
                raise DistributedOperationException(hang_watchdog.explain_failure(name, seq, error)) from error
            finally:
                hang_watchdog.leave()

        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            return run(agree or (_first_argument_shapes if debug_mode.active() else None), args, kwargs)

        def agreed(*args, **kwargs):
            return run(None, args, kwargs)

        wrapper.agreed = agreed
        return wrapper

    return decorate


def barrier() -> None:
    """Block until every process reaches this point."""
    _barrier()


@_collective("wait_for_everyone", agree=_no_inputs)
def _barrier() -> None:
    if _world()[0] > 1:
        dist.barrier()


def _gather_one(tensor: torch.Tensor) -> torch.Tensor:
    world, _ = _world()
    if tensor.ndim == 0:
        tensor = tensor[None]
    tensor = tensor.contiguous()
    if dist.get_backend() == "nccl":
        out = torch.empty(
            (world * tensor.shape[0],) + tuple(tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device
        )
        collective_check.all_gather_flat(out, tensor)
        return out
    parts = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(parts, tensor)
    return torch.cat(parts, dim=0)


def _gather_structure(data):
    """Gather every tensor of ``data``; several tensors travel as one buffer (one collective instead of one each)."""
    if isinstance(data, torch.Tensor):
        return _gather_one(data)
    leaves = list(_leaves(data))
    if len(leaves) < 2 or not _fusable(leaves):
        return recursively_apply(_gather_one, data)
    gathered = iter(_gather_fused(leaves))
    return recursively_apply(lambda _: next(gathered), data)


_ALIGN = 16  # bytes: every tensor starts where any dtype may be viewed


def _fusable(leaves: list[torch.Tensor]) -> bool:
    """Plain dense tensors on one device (not subclasses such as DTensor, not sparse or quantized ones)."""
    device = leaves[0].device
    plain = (torch.Tensor, torch.nn.Parameter)
    return all(
        type(t) in plain and t.device == device and t.layout == torch.strided and not t.is_quantized for t in leaves
    )


def _gather_fused(leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    """All-gather ``leaves`` (same device, any dtypes) as the bytes of one buffer; returns each one's gather."""
    world, _ = _world()
    flat = [(t[None] if t.ndim == 0 else t).detach().contiguous() for t in leaves]
    sizes = [t.numel() * t.element_size() for t in flat]
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += -(-size // _ALIGN) * _ALIGN
    buffer = torch.empty(total, dtype=torch.uint8, device=flat[0].device)
    for t, offset, size in zip(flat, offsets, sizes):
        buffer[offset : offset + size] = t.reshape(-1).view(torch.uint8)
    out = torch.empty(world * total, dtype=torch.uint8, device=buffer.device)
    collective_check.all_gather_flat(out, buffer)
    starts = [r * total for r in range(world)]
    return [
        torch.cat([out[start + offset : start + offset + size].view(t.dtype).view(t.shape) for start in starts])
        for t, offset, size in zip(flat, offsets, sizes)
    ]


@_collective("gather", agree=lambda tensor: collective_check.same_tensors(tensor))
def gather(tensor):
    """Gather tensors from every process and concatenate them on the first dimension.

    0-dimensional tensors become 1-dimensional. Every process gets the result. On one process ``tensor``
    comes back as it is (the same object, unchecked), as in Accelerate. Every process must pass the same
    structure, shapes and dtypes; otherwise every process raises
    :class:`~hasten.errors.DistributedOperationException` naming each one's shapes.
    """
    if _world()[0] == 1:
        return tensor
    _require_tensors(tensor, "gather")
    return _gather_structure(tensor)


@_collective("gather_object", agree=_no_inputs)
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


def _broadcast_agree(tensor, from_process: int = 0):
    return collective_check.same_tensors(tensor), from_process


@_collective("broadcast", agree=_broadcast_agree)
def broadcast(tensor, from_process: int = 0):
    """Copy every tensor of ``tensor`` from process ``from_process`` to all others, in place; returns it."""
    if _world()[0] == 1:
        return tensor
    _require_tensors(tensor, "broadcast")

    def _one(t):
        dist.broadcast(t, src=from_process)
        return t

    return recursively_apply(_one, tensor)


@_collective("broadcast_object_list", agree=lambda object_list, from_process=0: (len(object_list), from_process))
def broadcast_object_list(object_list: list, from_process: int = 0) -> list:
    """Replace the items of ``object_list`` in place with those of process ``from_process``; returns it."""
    if _world()[0] > 1:
        dist.broadcast_object_list(object_list, src=from_process)
    return object_list


_REDUCE_OPS = {"sum": "SUM", "mean": "SUM", "max": "MAX", "min": "MIN"}


def _reduce_agree(tensor, reduction: str = "mean", scale: float = 1.0):
    return collective_check.same_tensors(tensor), reduction


@_collective("reduce", agree=_reduce_agree)
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


def _pad_one(tensor: torch.Tensor, dim: int, pad_index, pad_first: bool, sizes: list[int], dtype=None) -> torch.Tensor:
    """``tensor`` padded along ``dim`` to the largest of ``sizes`` (every process's size of that dimension), as
    ``dtype`` (default: the tensor's)."""
    if dim < 0:
        dim += tensor.ndim
    max_size = max(sizes)
    if max_size == tensor.shape[dim]:
        return tensor
    new_shape = list(tensor.shape)
    new_shape[dim] = max_size
    out = tensor.new_full(new_shape, pad_index, dtype=dtype or tensor.dtype)
    index = [slice(None)] * tensor.ndim
    index[dim] = slice(max_size - tensor.shape[dim], max_size) if pad_first else slice(0, tensor.shape[dim])
    out[tuple(index)] = tensor
    return out


def _paddable(tensor: torch.Tensor, dim: int) -> bool:
    return not tensor.is_nested and tensor.ndim > 0 and -tensor.ndim <= dim < tensor.ndim


def _pad_agree(tensor, dim: int = 0, pad_index: int = 0, pad_first: bool = False):
    return collective_check.same_ranks(tensor), dim


@_collective("pad_across_processes", agree=_pad_agree)
def pad_across_processes(tensor, dim: int = 0, pad_index: int = 0, pad_first: bool = False):
    """Pad every tensor to the largest size of dimension ``dim`` across processes, so it can be gathered.

    The sizes of every tensor of the structure travel in one exchange. Every process must pass the same
    structure with the same numbers of dimensions. As in Accelerate, the structure is rebuilt (a tensor already
    of the largest size comes back as it is), a tensor with fewer than ``dim`` dimensions is left as it is, a
    nested tensor is returned unpadded with a :class:`CannotPadNestedTensorWarning`, and the padded tensor has
    the dtype of ``tensor + pad_index``.

    Args:
        dim: the dimension to pad.
        pad_index: the value used for padding.
        pad_first: pad at the beginning instead of the end.
    """
    _require_tensors(tensor, "pad_across_processes")
    world, _ = _world()
    padded = [t for t in _leaves(tensor) if _paddable(t, dim)]
    every_size = iter([t.shape[dim]] for t in padded)
    if world > 1 and padded:
        local = torch.tensor([t.shape[dim] for t in padded], device=padded[0].device)
        every_size = iter(_gather_one(local).view(world, len(padded)).T.tolist())

    def _one(t):
        if t.is_nested:
            warnings.warn(
                "pad_across_processes cannot pad a nested tensor; it is returned as it is.",
                CannotPadNestedTensorWarning,
                stacklevel=5,
            )
            return t
        if not _paddable(t, dim):
            return t
        sizes = next(every_size)
        if max(sizes) == t.shape[dim]:
            return t
        return _pad_one(t, dim, pad_index, pad_first, sizes, dtype=torch.result_type(t, pad_index))

    return recursively_apply(_one, tensor)


def _sizes_agree(tensor, sizes: list[int]):
    rank = _world()[1]
    return collective_check.same_trailing(tensor, lambda t: t.ndim > 0 and t.shape[0] == sizes[rank]), list(sizes)


@_collective("gather_with_sizes", agree=_sizes_agree)
def gather_with_sizes(tensor, sizes: list[int]):
    """Gather tensors whose first dimension differs between processes, given every process's size.

    Used by ``gather_for_metrics`` on uneven last batches, where every rank knows all sizes, so no
    extra collective is needed to exchange them. Returns the concatenation without any padding; on one
    process, ``tensor`` as it is. Every process must pass tensors with the same dtypes and trailing
    dimensions, and its own size first.
    """
    if _world()[0] == 1:
        return tensor

    def _one(t):
        padded = _pad_one(t, 0, 0, False, sizes)
        full = _gather_one(padded)
        step = max(sizes)
        return torch.cat([full[i * step : i * step + n] for i, n in enumerate(sizes)], dim=0)

    return recursively_apply(_one, tensor)
