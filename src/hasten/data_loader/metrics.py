"""``gather_for_metrics``: gather evaluation outputs and drop the samples that were padded in.

Wherever Accelerate 1.15 gives a result, hasten gives the same: the gathered data (on one process, the data
as it is), cut on the last batch of a prepared loader to the loader's ``remainder`` (the dataset's length
modulo the total batch size) when that is positive. That covers one process, every batch inside a loop but
the last, and the last batch and after-the-loop calls whenever every process holds the same shapes (the gather's
own check tells, in the same collective). Where the processes hold different numbers of rows
(``even_batches=False``: Accelerate's gather fails there), hasten gathers each process's rows at their sizes:

- on the last batch, when they match the loader's layout, the padded samples are dropped; otherwise every
  row is gathered as it is (with a warning);
- after the loop, on outputs collected during it (one concatenated tensor, or the list of batches; a rank
  that got no batch in the last round has one batch fewer): when they match the epoch of the loader that ran
  last, the result is the dataset exactly, in order; otherwise every rank's rows, in rank order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import DistributedOperationException
from ..runtime.operations import UNEVEN, gather, gather_if_even, gather_object, gather_with_sizes
from ..runtime.tree import _leaves, recursively_apply
from ..state import GradientState, warn_once
from .sharding import FinalRound


def _is_tensor_structure(data) -> bool:
    try:
        recursively_apply(lambda t: t, data, error_on_other_type=True)
    except TypeError:
        return False
    return any(True for _ in _leaves(data))


def _tensors_or_empty(data) -> bool:
    """Tensors, or an empty list (which Accelerate's check accepts, and which a process that got no batch in
    the last round collects): such data takes the tensor path on every process alike."""
    return _is_tensor_structure(data) or (isinstance(data, (list, tuple)) and not data)


def _truncate(data, rows: int):
    return recursively_apply(lambda t: t[:rows], data)


def gather_for_metrics(input_data, state: GradientState, use_gather_object: bool = False):
    """Gather ``input_data`` from all processes for metric computation, without the samples padded in.

    Where Accelerate gives a result, this is Accelerate's result: the gathered data, cut on the last batch of a
    prepared loader to its ``remainder`` (the samples padded in to complete the last round dropped). Where the
    processes hold different numbers of rows (``even_batches=False``, where Accelerate's gather fails), the
    rows are gathered at their sizes: on the last batch as the loader laid them out, and after the loop, on
    the outputs collected during it (concatenated, or the list of batches), the dataset exactly, in order.
    Non-tensor data (or ``use_gather_object=True``) goes through ``gather_object``. ``state`` is the caller's
    :class:`~hasten.state.GradientState`: which loader is being iterated, and after the loop which one ran last.
    """
    loader = state.active_dataloader
    as_objects = use_gather_object or not _tensors_or_empty(input_data)
    if not _distributed() or as_objects or (loader is not None and not loader.end_of_dataloader):
        return _as_accelerate_does(input_data, use_gather_object, state)
    if loader is None:
        input_data = _with_missing_last_batch(input_data, _EpochLayout.of(state.last_dataloader()))
    gathered = gather_if_even(input_data)
    if gathered is not UNEVEN:  # the same shapes everywhere (one collective): Accelerate's result
        return _cut_to_remainder(gathered, False, state)
    rows = _exchange_rows(input_data)
    if rows is None:  # another process passed something else than tensors
        return _gather_objects(input_data)
    if len(set(rows)) == 1:  # the same shapes everywhere: Accelerate's gather works, and its result is the one
        return _as_accelerate_does(input_data, False, state)
    if loader is None:
        return _gather_after_loop(input_data, rows, _EpochLayout.of(state.last_dataloader()))
    final = loader.final_round
    if final is None or any(r != (size,) * len(r) for r, size in zip(rows, final.sizes)):
        warn_once(
            "metrics-layout",
            f"gather_for_metrics got {[r[0] if r else None for r in rows]} rows per process on the last batch where "
            f"the dataloader gave {list(final.sizes) if final is not None else 'an unknown layout'}; the gathered "
            "result is returned without dropping padded samples.",
        )
        return _gather_leaves(input_data, rows, None)
    gathered = gather_with_sizes(input_data, list(final.sizes))
    return _truncate(gathered, final.real) if final.padded else gathered


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _as_accelerate_does(data, use_gather_object: bool, state: GradientState):
    """Accelerate's rule, for one process and for a last round whose layout is unknown: gather (on one process,
    ``data`` as it is), and on the last batch keep the first ``remainder`` rows (``remainder`` > 0)."""
    as_objects = use_gather_object or not _tensors_or_empty(data)
    if _distributed():
        data = _gather_objects(data) if as_objects else gather(data)
    return _cut_to_remainder(data, as_objects, state)


def _cut_to_remainder(data, as_objects: bool, state: GradientState):
    """Accelerate's cut of gathered ``data``: on the last batch keep the first ``remainder`` rows."""
    remainder = state.remainder
    if not state.end_of_dataloader or remainder <= 0:
        return data
    try:
        return data[:remainder] if as_objects else _truncate(data, remainder)
    except Exception:  # noqa: BLE001 - as Accelerate: what cannot be cut (a 0-d tensor, an object) comes back whole
        return data


def _gather_objects(data) -> list:
    """Every process's ``data`` iterated into one list, in rank order: Accelerate's object gather (a tensor
    gives its rows)."""
    return [item for part in gather_object([data]) for item in part]


def _exchange_rows(data) -> list[tuple[int, ...]] | None:
    """Every rank's first-dimension sizes, one tuple per rank (-1 for a 0-dimensional leaf), in one exchange.

    None when any rank's input is not a structure of tensors (a rank may hold an empty list): then every
    rank goes through ``gather_object``.
    """
    mine = [t.shape[0] if t.ndim else -1 for t in _leaves(data)] if _is_tensor_structure(data) else None
    everyone = gather_object([mine])
    if any(r is None for r in everyone):
        return None
    everyone = [tuple(r) for r in everyone]
    if len({len(r) for r in everyone}) > 1:
        raise DistributedOperationException(
            "gather_for_metrics: the processes passed structures with different numbers of tensors "
            f"({[len(r) for r in everyone]}); every process must pass the same structure."
        )
    return everyone


@dataclass(frozen=True)
class _EpochLayout:
    """The rows each rank received in each round of the last complete epoch of a prepared loader."""

    rounds: tuple[tuple[int, ...], ...]
    final: FinalRound

    @classmethod
    def of(cls, loader) -> _EpochLayout | None:
        final = getattr(loader, "final_round", None)
        total = getattr(loader, "total_batch_size", None)
        try:
            rounds = getattr(loader.batch_sampler, "rounds", None) or len(loader)  # len() is per rank
        except TypeError:  # an iterable dataset without a length
            return None
        if final is None or not total or rounds < 1:
            return None
        world = len(final.sizes)
        full = (total // world,) * world
        return cls(tuple([full] * (rounds - 1) + [final.sizes]), final)

    def per_rank(self) -> tuple[int, ...]:
        return tuple(sum(sizes) for sizes in zip(*self.rounds))

    def real_rows(self) -> int:
        return sum(sum(sizes) for sizes in self.rounds[:-1]) + (
            self.final.real if self.final.padded else sum(self.final.sizes)
        )


def _gather_after_loop(data, rows, layout: _EpochLayout | None):
    if (
        layout is not None
        and isinstance(data, (list, tuple))
        and len(data) == len(layout.rounds)
        and not _matches(rows, layout.per_rank())
    ):
        counts = [sum(1 for _ in _leaves(item)) for item in data]
        if all(_matches(_slice_rows(rows, counts, k), sizes) for k, sizes in enumerate(layout.rounds)):
            batches = [gather_with_sizes(item, list(sizes)) for item, sizes in zip(data, layout.rounds)]
            if layout.final.padded:
                batches[-1] = _truncate(batches[-1], layout.final.real)
            return type(data)(batches) if type(data) in (list, tuple) else batches
    return _gather_leaves(data, rows, layout)


def _with_missing_last_batch(data, layout: _EpochLayout | None):
    """A list of batches from a rank that got no batch in the last round (``even_batches=False``), completed
    with an empty one, so that every rank passes the same structure."""
    if layout is None or not isinstance(data, (list, tuple)) or not data or 0 not in layout.final.sizes:
        return data
    if len(data) != len(layout.rounds) - 1 or not _is_tensor_structure(data[-1]):
        return data
    return type(data)([*data, recursively_apply(lambda t: t[:0], data[-1])])


def _matches(rows: list[tuple[int, ...]], sizes: tuple[int, ...]) -> bool:
    return bool(rows[0]) and all(r == (size,) * len(r) for r, size in zip(rows, sizes))


def _slice_rows(rows, counts, k):
    start = sum(counts[:k])
    return [r[start : start + counts[k]] for r in rows]


def _gather_leaves(data, rows, layout: _EpochLayout | None):
    """Gather each leaf at its exact sizes; leaves shaped like ``layout``'s epoch come back in dataset order."""
    per_leaf = iter(zip(*rows))

    def one(tensor):
        sizes = list(next(per_leaf))
        if -1 in sizes:
            return gather(tensor)
        gathered = gather_with_sizes(tensor, sizes)
        if layout is None or tuple(sizes) != layout.per_rank():
            return gathered
        return _dataset_order(gathered, layout)

    return recursively_apply(one, data)


def _dataset_order(gathered: torch.Tensor, layout: _EpochLayout) -> torch.Tensor:
    """Turn rank-major rows (all of rank 0's rounds, then rank 1's...) into round-major order, padding dropped."""
    starts, offset = [], 0
    for rank_rows in layout.per_rank():
        starts.append(offset)
        offset += rank_rows
    pieces, position = [], [0] * len(starts)
    for sizes in layout.rounds:
        for rank, size in enumerate(sizes):
            begin = starts[rank] + position[rank]
            pieces.append(gathered[begin : begin + size])
            position[rank] += size
    return torch.cat(pieces)[: layout.real_rows()]
