"""Collectives on arbitrarily nested structures of tensors (the structure helpers are in :mod:`hasten.runtime.tree`).

Every collective accepts a tensor or a list / tuple / namedtuple / dict (any ``Mapping``) nesting tensors,
and returns the same structure.

On a single process the collectives return their input (``gather``/``reduce`` return copies).
In every mode each collective first checks that every process runs the same operation on inputs that fit
(shapes, dtypes, arguments), and raises on every process instead of returning a wrong tensor; a small payload
travels inside that check, so that a collective repeated with the same sizes (a gather of each evaluation batch,
a reduce of each step's loss) is one all-gather (see :mod:`hasten.runtime.collective_check`). A collective that
does not complete within ``HASTEN_HANG_TIMEOUT`` ends the job with a report, and one whose peer is gone names where
that peer stopped (see :mod:`hasten.runtime.hang_watchdog`).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from ..errors import DistributedOperationException, HastenError
from . import collective_check, debug_mode, hang_watchdog
from .memory import should_reduce_batch_size
from .packing import Packing, fusable, pickled, unpickled
from .tree import CannotPadNestedTensorWarning, StructureTypeError, _leaves, _require_tensors, recursively_apply

# ----------------------------------------------------------------------------------- collectives


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        found = collective_check.channel()
        return found.size, found.rank
    return 1, 0


class _Call:
    """One collective in progress: its name and number, and the exchange that checks it (see ``_calling``)."""

    def __init__(self, name: str, seq: int, checked: bool):
        self.name, self.seq, self.checked = name, seq, checked

    def exchange(
        self, agree: Callable, args: tuple, kwargs: dict | None = None, packing: Packing | None = None, **options
    ) -> collective_check.Exchanged | None:
        """Check that every process runs this collective on inputs that fit (``agree(*args, **kwargs)`` returns
        what must be equal), with ``packing``'s bytes riding along when they fit; None when the call is unchecked.
        ``options``: ``size`` and ``fill`` for a payload that is not a packing, ``lenient``."""
        if not self.checked:
            return None
        if packing is not None:
            options.update(size=packing.total, fill=packing.fill)
        return collective_check.exchange(self.name, self.seq, agree, args, kwargs or {}, **options)


@contextlib.contextmanager
def _calling(name: str, checked: bool = True) -> Iterator[_Call]:
    """Run one collective: the hang watchdog records it, and a failure to communicate names where the other
    processes are. ``checked=False`` is for hasten's own callers whose processes agree by construction (the
    dispatcher's per-batch broadcasts, whose receivers allocate from the shapes the sender sent)."""
    seq = hang_watchdog.enter(name)
    try:
        yield _Call(name, seq, checked)
    except RuntimeError as error:
        if isinstance(error, HastenError) or should_reduce_batch_size(error):
            raise
        raise DistributedOperationException(hang_watchdog.explain_failure(name, seq, error)) from error
    finally:
        hang_watchdog.leave()


def _first_argument_shapes(*args, **kwargs):
    return collective_check.same_tensors(args[0]) if args else None


def _collective(name: str):
    """Mark a user's function as a collective (``verify_operation``): the hang watchdog records it, a failure to
    communicate names where the other processes are, and in debug mode every process first checks that all of
    them call it with first arguments of the same shapes, as Accelerate's does."""

    def decorate(function):
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            if _world()[0] == 1:  # one process has nothing to wait for
                return function(*args, **kwargs)
            with _calling(name, checked=debug_mode.active()) as call:
                call.exchange(_first_argument_shapes, args, kwargs)
                return function(*args, **kwargs)

        return wrapper

    return decorate


def _riding(leaves: list[torch.Tensor]) -> Packing | None:
    """The packing of ``leaves`` when their bytes can travel inside the check (CPU tensors, a group that moves
    them), else None."""
    if not leaves or not fusable(leaves) or leaves[0].device.type != "cpu" or not collective_check.payloads_ride():
        return None
    return Packing.of(leaves)


def _leaf_list(data) -> list[torch.Tensor]:
    try:
        return list(_leaves(data))
    except Exception:  # noqa: BLE001 - what cannot be walked has no payload; the check reports it on every process
        return []


def barrier() -> None:
    """Block until every process reaches this point."""
    if _world()[0] == 1:
        return
    with _calling("wait_for_everyone") as call:
        exchanged = call.exchange(_no_inputs, (), size=0)
        if exchanged.rows is None:  # the check went over a side group: the default group's own barrier
            dist.barrier()


def _no_inputs(*args, **kwargs) -> None:
    """What must agree for a collective whose inputs may differ between processes: nothing but the operation."""


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


def _gather_leaves(data, leaves: list[torch.Tensor], exchanged) -> Any:
    """Gather every tensor of ``data``: from the bytes that came with the check, or in one more collective
    (several tensors as one buffer, one collective instead of one each)."""
    if exchanged is not None and exchanged.rows is not None:
        gathered = iter(Packing.of(leaves).concatenate(exchanged.rows))
    elif isinstance(data, torch.Tensor):
        return _gather_one(data)
    elif len(leaves) < 2 or not fusable(leaves):
        return recursively_apply(_gather_one, data)
    else:
        packing = Packing.of(leaves)
        out = torch.empty(_world()[0] * packing.total, dtype=torch.uint8, device=leaves[0].device)
        collective_check.all_gather_flat(out, packing.packed())
        gathered = iter(packing.concatenate(out.view(_world()[0], packing.total)))
    if isinstance(data, torch.Tensor):
        return next(gathered)
    return recursively_apply(lambda _: next(gathered), data)


def gather(tensor):
    """Gather tensors from every process and concatenate them on the first dimension.

    0-dimensional tensors become 1-dimensional. Every process gets the result. On one process ``tensor``
    comes back as it is (the same object, unchecked), as in Accelerate. Every process must pass the same
    structure, shapes and dtypes; otherwise every process raises
    :class:`~hasten.errors.DistributedOperationException` naming each one's shapes.
    """
    if _world()[0] == 1:
        return tensor
    with _calling("gather") as call:
        leaves = _leaf_list(tensor)
        exchanged = call.exchange(collective_check.same_tensors, (tensor,), packing=_riding(leaves))
        _require_tensors(tensor, "gather")
        return _gather_leaves(tensor, leaves, exchanged)


UNEVEN = object()  # what gather_if_even returns when the processes hold different shapes


def gather_if_even(tensor):
    """Gather like :func:`gather` when every process holds the same structure, shapes and dtypes; otherwise (and
    when ``tensor`` holds no tensor at all) return :data:`UNEVEN` on every process, having moved no data.

    ``gather_for_metrics`` calls it on the last batch and after the loop: where the shapes agree (the common case)
    that is the only collective; where they do not, it then exchanges the row counts.
    """
    if _world()[0] == 1:
        return tensor
    with _calling("gather_for_metrics") as call:
        leaves = _leaf_list(tensor)
        packing = _riding(leaves)
        exchanged = call.exchange(collective_check.same_tensors, (tensor,), packing=packing, lenient=True)
        if not exchanged.agreed or not leaves:
            return UNEVEN
        _require_tensors(tensor, "gather_for_metrics")
        return _gather_leaves(tensor, leaves, exchanged)


def gather_object(object: Any):
    """Gather picklable objects from every process: the items of each process's list (or other iterable), in rank order.

    As in Accelerate, each process's object is iterated (a list gives its items, a dict its keys), and on one
    process ``object`` comes back as it is.
    """
    world, _ = _world()
    if world == 1:
        return object
    with _calling("gather_object") as call:
        data = pickled(object) if collective_check.payloads_ride() else None
        fill = None if data is None else lambda buffer: buffer.copy_(data)
        exchanged = call.exchange(_no_inputs, (object,), size=-1 if data is None else data.numel(), fill=fill)
        if data is None:
            output: list = [None] * world
            dist.all_gather_object(output, object)
        else:
            if exchanged.rows is not None:
                output = [unpickled(exchanged.part(rank)) for rank in range(world)]
            else:
                output = [unpickled(part) for part in _gather_bytes(data, exchanged.sizes)]
    try:
        return [item for part in output for item in part]
    except TypeError:
        kinds = sorted({type(part).__name__ for part in output})
        raise StructureTypeError(
            f"gather_object joins the lists of every process, but got {', '.join(kinds)}: wrap the object in a list, "
            "gather_object([obj]), to get one item per process."
        ) from None


def _gather_bytes(data: torch.Tensor, sizes: tuple[int, ...]) -> list[torch.Tensor]:
    """Every process's ``data`` (``uint8``, of the given sizes), in one all-gather of the largest size."""
    longest = max(sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: data.numel()] = data
    out = torch.empty(len(sizes) * longest, dtype=torch.uint8)
    collective_check.all_gather_flat(out, padded)
    return [out[r * longest : r * longest + size] for r, size in enumerate(sizes)]


def _broadcast_agree(tensor, from_process: int = 0):
    return collective_check.same_tensors(tensor), from_process


def broadcast(tensor, from_process: int = 0):
    """Copy every tensor of ``tensor`` from process ``from_process`` to all others, in place; returns it."""
    return _broadcast(tensor, from_process, checked=True)


def _broadcast(tensor, from_process: int = 0, checked: bool = True):
    world, rank = _world()
    if world == 1:
        return tensor
    with _calling("broadcast", checked) as call:
        leaves = _leaf_list(tensor)
        packing = _riding(leaves)
        options = {"packing": packing} if rank == from_process or packing is None else {"size": 0}
        exchanged = call.exchange(_broadcast_agree, (tensor,), {"from_process": from_process}, **options)
        _require_tensors(tensor, "broadcast")
        if exchanged is not None and exchanged.rows is not None:
            received = iter(packing.read(exchanged.part(from_process)) if rank != from_process else ())

            def _one(t):
                if rank != from_process:
                    t.copy_(next(received).view(t.shape))
                return t

            return recursively_apply(_one, tensor)

        def _send(t):
            dist.broadcast(t, src=from_process)
            return t

        return recursively_apply(_send, tensor)


broadcast.agreed = functools.partial(_broadcast, checked=False)


def broadcast_object_list(object_list: list, from_process: int = 0) -> list:
    """Replace the items of ``object_list`` in place with those of process ``from_process``; returns it."""
    return _broadcast_object_list(object_list, from_process, checked=True)


def _broadcast_object_list(object_list: list, from_process: int = 0, checked: bool = True) -> list:
    world, rank = _world()
    if world == 1:
        return object_list
    with _calling("broadcast_object_list", checked) as call:
        ride = collective_check.payloads_ride() and checked
        data = pickled(list(object_list)) if ride and rank == from_process else None
        options = {"size": -1 if not ride else 0 if data is None else data.numel()}
        if data is not None:
            options["fill"] = lambda buffer: buffer.copy_(data)
        exchanged = call.exchange(
            lambda objects, from_process: (len(objects), from_process),
            (object_list,),
            {"from_process": from_process},
            **options,
        )
        if not ride:
            dist.broadcast_object_list(object_list, src=from_process)
            return object_list
        if exchanged.rows is not None:
            payload = exchanged.part(from_process)
        else:
            payload = data if data is not None else torch.empty(exchanged.sizes[from_process], dtype=torch.uint8)
            dist.broadcast(payload, src=from_process)
        if rank != from_process:
            object_list[:] = unpickled(payload)
    return object_list


broadcast_object_list.agreed = functools.partial(_broadcast_object_list, checked=False)


_REDUCE_OPS = {"sum": "SUM", "mean": "SUM", "max": "MAX", "min": "MIN"}


def _reduce_agree(tensor, reduction: str = "mean", scale: float = 1.0):
    return collective_check.same_tensors(tensor), reduction


def _reduces_here(leaves: list[torch.Tensor], reduction: str, world: int) -> bool:
    """Whether reducing the gathered tensors here, in process order, gives the all-reduce's result bit for bit:
    integers in any order; floating sums of two processes (a + b is b + a); not a floating max or min (NaNs)."""
    if reduction == "none":
        return True
    if reduction not in _REDUCE_OPS or any(t.dtype == torch.bool for t in leaves):
        return False
    if all(not (t.is_floating_point() or t.is_complex()) for t in leaves):
        return True
    return world == 2 and reduction in ("sum", "mean")


def reduce(tensor, reduction: str = "mean", scale: float = 1.0):
    """All-reduce every tensor of ``tensor`` across processes; returns new tensors.

    Args:
        reduction: ``"mean"`` (default here; ``Accelerator.reduce`` defaults to ``"sum"``), ``"sum"``,
            ``"max"``, ``"min"`` or ``"none"`` (a copy, unreduced).
        scale: multiply the result by this factor.
    """
    world, _ = _world()
    if world == 1:
        return _reduce_structure(tensor, reduction, scale, world, None)
    with _calling("reduce") as call:
        leaves = _leaf_list(tensor)
        packing = _riding(leaves) if _reduces_here(leaves, reduction, world) else None
        if reduction == "none" and packing is not None:
            options = {"size": 0}
        else:
            options = {"packing": packing}
        exchanged = call.exchange(_reduce_agree, (tensor,), {"reduction": reduction, "scale": scale}, **options)
        received = packing.stacked(exchanged.rows) if exchanged.rows is not None and reduction != "none" else None
        return _reduce_structure(tensor, reduction, scale, world, received)


def _reduce_structure(tensor, reduction: str, scale: float, world: int, received: list | None):
    """Reduce every tensor of ``tensor``: from every process's values ``received`` with the check (per tensor, one
    of shape ``(processes, *shape)``), or with an all-reduce each."""
    if reduction not in (*_REDUCE_OPS, "none"):
        raise ValueError(f"reduce(reduction={reduction!r}): choose one of 'sum', 'mean', 'max', 'min', 'none'.")
    _require_tensors(tensor, "reduce")
    every_process = iter(received) if received is not None else None

    def _one(t):
        if every_process is not None:
            out = _combined(next(every_process), reduction).view(t.shape)
        else:
            out = t.clone()
            if world > 1 and reduction != "none":
                dist.all_reduce(out, op=getattr(dist.ReduceOp, _REDUCE_OPS[reduction]))
        if world > 1 and reduction == "mean":
            out /= world
        if scale != 1.0:
            out *= scale
        return out

    return recursively_apply(_one, tensor)


def _combined(pieces: torch.Tensor, reduction: str) -> torch.Tensor:
    """``pieces[0]``, ``pieces[1]``, ... reduced in process order (never ``sum(dim=0)``, which starts from +0.0)."""
    out = pieces[0].clone()
    for piece in pieces[1:]:
        if reduction in ("sum", "mean"):
            out += piece
        elif reduction == "max":
            torch.maximum(out, piece, out=out)
        else:
            torch.minimum(out, piece, out=out)
    return out


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
    world, _ = _world()
    if world == 1:
        _require_tensors(tensor, "pad_across_processes")
        return _pad_structure(tensor, dim, pad_index, pad_first, None)
    with _calling("pad_across_processes") as call:
        padded = [t for t in _leaf_list(tensor) if _paddable(t, dim)]
        local = torch.tensor([t.shape[dim] for t in padded], dtype=torch.int64)
        packing = _riding([local]) if padded else None
        exchanged = call.exchange(
            _pad_agree, (tensor,), {"dim": dim, "pad_index": pad_index, "pad_first": pad_first}, packing=packing
        )
        _require_tensors(tensor, "pad_across_processes")
        if not padded:
            return _pad_structure(tensor, dim, pad_index, pad_first, None)
        if exchanged.rows is not None:
            every = packing.stacked(exchanged.rows)[0]
        else:
            every = _gather_one(local.to(padded[0].device)).view(world, len(padded))
        return _pad_structure(tensor, dim, pad_index, pad_first, iter(every.T.tolist()))


def _pad_structure(tensor, dim: int, pad_index, pad_first: bool, every_size: Iterator | None):
    def _one(t):
        if t.is_nested:
            warnings.warn(
                "pad_across_processes cannot pad a nested tensor; it is returned as it is.",
                CannotPadNestedTensorWarning,
                stacklevel=6,
            )
            return t
        if not _paddable(t, dim):
            return t
        sizes = next(every_size) if every_size is not None else [t.shape[dim]]
        if max(sizes) == t.shape[dim]:
            return t
        return _pad_one(t, dim, pad_index, pad_first, sizes, dtype=torch.result_type(t, pad_index))

    return recursively_apply(_one, tensor)


def _sizes_agree(tensor, sizes: list[int]):
    rank = _world()[1]
    return collective_check.same_trailing(tensor, lambda t: t.ndim > 0 and t.shape[0] == sizes[rank]), list(sizes)


def gather_with_sizes(tensor, sizes: list[int]):
    """Gather tensors whose first dimension differs between processes, given every process's size.

    Used by ``gather_for_metrics`` on uneven last batches, where every rank knows all sizes, so no
    extra collective is needed to exchange them. Returns the concatenation without any padding; on one
    process, ``tensor`` as it is. Every process must pass tensors with the same dtypes and trailing
    dimensions, and its own size first.
    """
    if _world()[0] == 1:
        return tensor
    with _calling("gather_with_sizes") as call:
        try:
            padded = [_pad_one(t, 0, 0, False, sizes) for t in _leaf_list(tensor)]
        except Exception:  # noqa: BLE001 - inputs that do not fit are reported by the check, on every process
            padded = []
        exchanged = call.exchange(_sizes_agree, (tensor,), {"sizes": sizes}, packing=_riding(padded))
        step = max(sizes)
        if exchanged.rows is not None:
            gathered = iter(Packing.of(padded).concatenate(exchanged.rows))
        else:
            gathered = iter(_gather_one(t) for t in padded)

        def _one(_):
            full = next(gathered)
            return torch.cat([full[i * step : i * step + n] for i, n in enumerate(sizes)], dim=0)

        return recursively_apply(_one, tensor)
