"""``gather_for_metrics``: gather evaluation outputs and drop the samples that were padded in.

On one process, and on a last batch whose layout hasten cannot describe (a batch sampler whose batch
sizes vary), it does what Accelerate does: the gathered data, cut on the last batch to the loader's
``remainder`` (the dataset's length modulo the total batch size) when that is positive. Otherwise every rank
takes the same path, decided from facts all ranks share (whether a prepared loader is running, whether
this is its last batch, its layout) or from one agreed exchange of row counts:

- inside a loop, on any batch but the last: a plain ``gather`` (every rank holds a full batch);
- on the last batch: the ranks exchange their row counts (one small collective per epoch); when they
  match the loader's layout the padded samples are dropped, otherwise every row is gathered as it is;
- after the loop, on outputs collected during it (one concatenated tensor, or the list of batches; a
  rank that got no batch in the last round, ``even_batches=False``, has one batch fewer): the ranks
  exchange their row counts; when they match the epoch of the loader that ran last, the
  result is the dataset exactly, in order, padding dropped; otherwise every rank's rows, in rank order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import DistributedOperationException
from ..runtime.operations import gather, gather_object, gather_with_sizes
from ..runtime.tree import _leaves, recursively_apply
from ..state import GradientState, warn_once
from .sharding import FinalRound


def _is_tensor_structure(data) -> bool:
    try:
        recursively_apply(lambda t: t, data, error_on_other_type=True)
    except TypeError:
        return False
    return any(True for _ in _leaves(data))


def _truncate(data, rows: int):
    return recursively_apply(lambda t: t[:rows], data)


def gather_for_metrics(input_data, use_gather_object: bool = False):
    """Gather ``input_data`` from all processes for metric computation, without duplicated samples.

    Over a prepared evaluation loader of N samples, the concatenation of the results of every batch is
    exactly the N predictions, in dataset order; so is the result of one call after the loop on the
    batches collected during it (concatenated, or as the list of batches). Non-tensor data (or
    ``use_gather_object=True``) goes through ``gather_object``.
    """
    state = GradientState()
    loader = state.active_dataloader
    final = loader.final_round if loader is not None and loader.end_of_dataloader else None
    if not _distributed() or (final is None and state.end_of_dataloader):
        return _as_accelerate_does(input_data, use_gather_object, state)
    if not use_gather_object and loader is not None and final is None:  # inside the loop: every rank holds a full batch
        return gather(input_data) if _is_tensor_structure(input_data) else gather_object(input_data)
    if loader is None and not use_gather_object:
        input_data = _with_missing_last_batch(input_data, _EpochLayout.of(state.last_dataloader()))
    rows = None if use_gather_object else _exchange_rows(input_data)
    if rows is None:
        data = gather_object(input_data)
        return data[: final.real] if final is not None and final.padded else data
    if loader is None:
        return _gather_after_loop(input_data, rows, _EpochLayout.of(state.last_dataloader()))
    if any(r != (size,) * len(r) for r, size in zip(rows, final.sizes)):
        warn_once(
            "metrics-layout",
            f"gather_for_metrics got {[r[0] if r else None for r in rows]} rows per process on the last batch where the dataloader "
            f"gave {list(final.sizes)}; the gathered result is returned without dropping padded samples.",
        )
        return _gather_leaves(input_data, rows, None)
    gathered = gather(input_data) if len(set(final.sizes)) == 1 else gather_with_sizes(input_data, list(final.sizes))
    return _truncate(gathered, final.real) if final.padded else gathered


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _as_accelerate_does(data, use_gather_object: bool, state: GradientState):
    """Accelerate's rule, for one process and for a last round whose layout is unknown: gather (on one process,
    ``data`` as it is), and on the last batch keep the first ``remainder`` rows (``remainder`` > 0)."""
    as_objects = use_gather_object or not (_is_tensor_structure(data) or (isinstance(data, list) and not data))
    if _distributed():
        data = gather_object(data) if as_objects else gather(data)
    remainder = state.remainder
    if not state.end_of_dataloader or remainder <= 0:
        return data
    try:
        return data[:remainder] if as_objects else _truncate(data, remainder)
    except Exception:  # noqa: BLE001 - as Accelerate: data that cannot be cut (a 0-d tensor, an object) comes back whole
        return data


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
            f"gather_for_metrics: the processes passed structures with different numbers of tensors ({[len(r) for r in everyone]}); "
            "every process must pass the same structure."
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
        return sum(sum(sizes) for sizes in self.rounds[:-1]) + (self.final.real if self.final.padded else sum(self.final.sizes))


def _gather_after_loop(data, rows, layout: _EpochLayout | None):
    if layout is not None and isinstance(data, (list, tuple)) and len(data) == len(layout.rounds) and not _matches(rows, layout.per_rank()):
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
