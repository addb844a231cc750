"""The dispatched dataloader (:class:`DataLoaderDispatcher`): rank 0 iterates the user's loader and sends
each process its rows (``dispatch_batches=True``, or an iterable dataset that cannot be sharded), with
the row helpers it slices, pads and broadcasts nested batches with.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping

import torch
from torch.utils.data import DataLoader

from ..runtime import preemption
from ..runtime.operations import broadcast, broadcast_object_list
from ..runtime.tree import send_to_device
from .epoch_rng import draw_iterator_seed
from .loaders import DataLoaderStateMixin
from .position import rows_in, skip_samples
from .sharding import FinalRound


class DataLoaderDispatcher(DataLoaderStateMixin, DataLoader):
    """A ``DataLoader`` read only on the main process, which sends each process its rows of every batch.

    Use it for data that cannot be read on every process (streams, generators). Tensors travel by
    broadcast; other leaves (e.g. lists of strings) travel with the batch's description.

    Args:
        split_batches: each loader batch is the global batch (split between processes); otherwise the
            main process reads ``num_processes`` batches per step.
        even_batches: recorded only: as in Accelerate, the last global batch is completed (with the first rows
            of the epoch) just up to a multiple of the number of processes, whatever this says.
        device: where batches are placed.
        slice_fn: ``slice_fn(batch, rows, process_index, num_processes)`` returning this process's part of
            a global batch (``rows`` is a ``slice``); by default every tensor and list is cut on its first dimension.

    The private arguments are what :func:`prepare_data_loader` settled; ``_state`` and ``_gradient_state`` are the
    preparing Accelerator's (None: the process's), whose processes share the batches.
    """

    def __init__(
        self,
        dataset,
        split_batches: bool = False,
        even_batches: bool = True,
        device=None,
        _non_blocking: bool = False,
        slice_fn=None,
        _batch_size: int = 1,
        _drop_last: bool = False,
        _state=None,
        _gradient_state=None,
        **kwargs,
    ):
        super().__init__(dataset, **kwargs)
        self._init_state(_state, _gradient_state)
        self._batch_size, self._drop_last = _batch_size, _drop_last
        self._world, self._rank = self._process.num_processes, self._process.process_index
        self.split_batches = split_batches
        self.even_batches = even_batches
        self.device = torch.device(device) if device is not None else self._process.device
        self._non_blocking = _non_blocking
        self._final: FinalRound | None = None
        self._slice_fn = slice_fn
        self._samples = 0

    @property
    def final_round(self) -> FinalRound | None:
        return self._final

    def _process_count(self) -> int:
        return self._world

    @property
    def _counts_samples(self) -> bool:
        return True

    def _samples_consumed(self) -> int:
        return self._samples

    def _per_round(self) -> int | None:
        return self.total_batch_size

    @property
    def total_batch_size(self) -> int:
        """Samples per step across all processes."""
        return self._batch_size if self.split_batches else self._batch_size * self._world

    def __len__(self) -> int:
        length = super().__len__()
        if self.split_batches:
            return length
        return length // self._world if self._drop_last else math.ceil(length / self._world)

    def _fetch(self, iterator):
        if self.split_batches:
            return next(iterator, None)
        parts = []
        for _ in range(self._world):
            batch = next(iterator, None)
            if batch is None:
                break
            parts.append(batch)
        if not parts or (self._drop_last and len(parts) < self._world):
            return None
        return parts[0] if len(parts) == 1 else _concat_rows(parts)

    def _layout(self, batch, first, is_last: bool):
        """Accelerate's cut: ``rows // N`` rows per process; a last batch whose rows do not divide is completed,
        unless ``drop_last``, with the first rows of the epoch's first batch up to the next multiple of ``N``."""
        rows, world = rows_in(batch), self._world
        per = rows // world
        if not (is_last and not self._drop_last and rows % world):
            sizes = (per,) * world
            return batch, sizes, FinalRound(sum(sizes), sizes, False) if is_last else None
        padded = _pad_rows(batch, first, min(world, rows_in(first)))
        total, per = rows_in(padded), per + 1
        sizes = tuple(max(0, min(per, total - rank * per)) for rank in range(world))
        return padded, sizes, FinalRound(rows, sizes, True)

    def _main_process_batches(self, skip: int, samples: int | None):
        """(batch, sizes, final round, is last, samples consumed after it) for each step, on the main process.

        The epoch's first global batch is read even when skipped: the last one is completed from it.
        """
        source = super().__iter__()
        head = list(itertools.islice(source, 1 if self.split_batches else self._world))
        first = _concat_rows(head) if len(head) > 1 else (head[0] if head else None)
        consumed = 0

        def started(count: int) -> None:
            nonlocal consumed
            consumed = count

        batches = itertools.chain(head, source)
        if samples:
            batches = skip_samples(batches, samples, rows_in, lambda batch: None, started, is_main=True)
        for _ in range(skip):
            skipped = self._fetch(batches)
            if skipped is None:
                break
            consumed += rows_in(skipped)
        current = self._fetch(batches)
        while current is not None:
            upcoming = self._fetch(batches)
            batch, sizes, final = self._layout(current, first, upcoming is None)
            consumed += rows_in(current)
            yield batch, sizes, final, upcoming is None, consumed
            current = upcoming

    def _exchange(self, item):
        """Broadcast one (batch, sizes, final, is_last, samples) from the main process; None means the data ended."""
        if self._rank == 0:
            if item is None:
                broadcast_object_list.agreed([None])
                return None
            batch, *layout = item
            batch = send_to_device(batch, self.device)
            broadcast_object_list.agreed([(_describe(batch), *layout)])
            _broadcast_leaves(batch)
            return batch, *layout
        (payload,) = broadcast_object_list.agreed([None])
        if payload is None:
            return None
        spec, *layout = payload
        batch = _materialise(spec, self.device)
        _broadcast_leaves(batch)
        return batch, *layout

    def __iter__(self):
        if preemption.save_due:
            preemption.batch_requested(self)
        resume = self._take_resume()
        source = None
        if resume is not None:  # None: the epoch resumed with zero batches left, nothing to draw
            skip, samples = resume
            self._samples = samples or 0
            self._propagate_epoch()
            with self._epoch_randomness():  # every rank draws what creating the iterator draws, as in Accelerate
                if self._rank == 0:
                    batches = self._main_process_batches(skip, samples)
                    source = itertools.chain(list(itertools.islice(batches, 1)), batches)
                else:
                    draw_iterator_seed(self)
        self.begin()
        try:
            while True:
                item = self._exchange(next(source, None) if source is not None else None)
                if item is None:
                    break
                batch, sizes, final, is_last, self._samples = item
                start = sum(sizes[: self._rank])
                rows = slice(start, start + sizes[self._rank])
                local = (
                    self._slice_fn(batch, rows, self._rank, self._world)
                    if self._slice_fn
                    else _slice_rows(batch, rows.start, rows.stop)
                )
                if is_last:
                    self._final, self.end_of_dataloader, self.remainder = final, True, final.real
                self._yielded += 1
                yield local
                if preemption.save_due:  # also after the last batch: the position then says "epoch done"
                    preemption.batch_requested(self)
                if is_last:
                    break
            self._finish_epoch()
        finally:
            self.end()


def _map_rows(batch, fn):
    """Apply ``fn(sequence)`` to every batch-dimension leaf (tensors and lists of plain values)."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        return type(batch)({k: _map_rows(v, fn) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_map_rows(v, fn) for v in batch))
    if isinstance(batch, (list, tuple)):
        if batch and isinstance(batch[0], (torch.Tensor, Mapping, list, tuple)):
            return type(batch)(_map_rows(v, fn) for v in batch)
        return fn(batch)
    return batch


def _slice_rows(batch, start: int, end: int):
    return _map_rows(batch, lambda seq: seq[start:end])


def _concat_rows(parts: list):
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts, dim=0)
    if isinstance(first, Mapping):
        return type(first)({k: _concat_rows([p[k] for p in parts]) for k in first})
    if isinstance(first, (list, tuple)) and first and isinstance(first[0], (torch.Tensor, Mapping, list, tuple)):
        return type(first)(_concat_rows([p[i] for p in parts]) for i in range(len(first)))
    if isinstance(first, (list, tuple)):
        return type(first)(x for p in parts for x in p)
    return first


def _pad_rows(batch, first, count: int):
    def pad(seq_pair):
        seq, source = seq_pair
        extra_index = [i % _len(source) for i in range(count)]
        if isinstance(seq, torch.Tensor):
            return torch.cat(
                [seq, source[torch.tensor(extra_index, dtype=torch.long, device=source.device)].to(seq.device)], dim=0
            )
        return type(seq)(list(seq) + [source[i] for i in extra_index])

    return _zip_rows(batch, first, pad)


def _len(seq) -> int:
    return seq.shape[0] if isinstance(seq, torch.Tensor) else len(seq)


def _zip_rows(batch, other, fn):
    if isinstance(batch, torch.Tensor):
        return fn((batch, other))
    if isinstance(batch, Mapping):
        return type(batch)({k: _zip_rows(v, other[k], fn) for k, v in batch.items()})
    if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], (torch.Tensor, Mapping, list, tuple)):
        items = [_zip_rows(v, o, fn) for v, o in zip(batch, other)]
        return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
    if isinstance(batch, (list, tuple)):
        return fn((batch, other))
    return batch


class _TensorSpec:
    __slots__ = ("shape", "dtype")

    def __init__(self, shape, dtype):
        self.shape, self.dtype = shape, dtype


def _describe(batch):
    if isinstance(batch, torch.Tensor):
        return _TensorSpec(tuple(batch.shape), batch.dtype)
    if isinstance(batch, Mapping):
        return type(batch)({k: _describe(v) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_describe(v) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_describe(v) for v in batch)
    return batch


def _materialise(spec, device):
    if isinstance(spec, _TensorSpec):
        return torch.empty(spec.shape, dtype=spec.dtype, device=device)
    if isinstance(spec, Mapping):
        return type(spec)({k: _materialise(v, device) for k, v in spec.items()})
    if isinstance(spec, tuple) and hasattr(spec, "_fields"):
        return type(spec)(*(_materialise(v, device) for v in spec))
    if isinstance(spec, (list, tuple)):
        return type(spec)(_materialise(v, device) for v in spec)
    return spec


def _broadcast_leaves(batch) -> None:
    if isinstance(batch, torch.Tensor):
        broadcast.agreed(batch)  # the receivers allocated it from the sender's description: no input check per step
    elif isinstance(batch, Mapping):
        for value in batch.values():
            _broadcast_leaves(value)
    elif isinstance(batch, (list, tuple)):
        for value in batch:
            _broadcast_leaves(value)
