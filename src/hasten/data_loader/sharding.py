"""How a dataset's batches are split between processes: Accelerate 1.15's layouts, batch for batch.

The layout is deterministic and the same on every rank, so each rank knows what the others get:
batches go round-robin (batch ``i`` to rank ``i % N``), or, with ``split_batches``, every batch is cut
into ``N`` contiguous pieces. Only the last *round* (the final ``N`` batches, or the final batch when
splitting) is normally incomplete:

* ``even_batches=True``: the round is completed with samples from the start of the epoch, so every
  rank gets a full batch; :class:`FinalRound` records how many samples are real so that
  ``gather_for_metrics`` drops the duplicates.
* ``even_batches=False``: nothing is duplicated: the leftover batches go to the first ranks (with
  ``split_batches``, the last batch is cut into pieces of the usual size from rank 0 on), and a rank with
  nothing left gets no batch, so its loop ends one step earlier. A training loop then needs
  ``accelerator.join_uneven_inputs`` (DDP), as in Accelerate.

A ``drop_last=True`` loader drops an incomplete last round. A batch sampler whose batches vary in size
is sharded as Accelerate shards it, quirks included (with a ``batch_size``, a round whose last batch is
short is not given out; a batch sampler without one deals whole batches), so that a script gets the
same batches on every process as under Accelerate.

Each shard can start an iteration after the first samples of the epoch's global order (a resumed position,
see :mod:`.position`) and counts the samples its rounds consume; a resumed last round is completed from the
epoch's first samples, skipped ones included, as the uninterrupted epoch's is.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Iterator

import torch
from torch.utils.data import BatchSampler, IterableDataset, RandomSampler, Sampler

from ..errors import ConfigError
from .position import SampleLedger, skip_samples


@dataclass(frozen=True)
class FinalRound:
    """The last round of an epoch: ``real`` samples in total, ``sizes[r]`` of them on rank ``r``.

    With ``padded`` True every rank holds ``sizes[r]`` samples of which only the first ``real`` (in
    rank order) are genuine; otherwise the sizes are exact.
    """

    real: int
    sizes: tuple[int, ...]
    padded: bool


class SeedableRandomSampler(RandomSampler):
    """A ``RandomSampler`` whose order depends only on ``seed + epoch``.

    Every rank with the same seed draws the same permutation, and a resumed run reproduces the epoch's
    order exactly. The seed is ``data_seed``, else the global torch seed (``torch.initial_seed()``, what
    ``set_seed`` sets), as in Accelerate. The epoch advances after each full pass; prepared loaders set
    it at each epoch start (:meth:`set_epoch`).
    """

    def __init__(
        self,
        data_source,
        replacement: bool = False,
        num_samples: int | None = None,
        generator=None,
        data_seed: int | None = None,
    ):
        super().__init__(data_source, replacement=replacement, num_samples=num_samples, generator=generator)
        self.initial_seed = int(torch.initial_seed() if data_seed is None else data_seed)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Use the permutation of ``epoch``."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        if self.generator is None:
            self.generator = torch.Generator()
        self.generator.manual_seed(self.initial_seed + self.epoch)
        yield from super().__iter__()
        self.set_epoch(self.epoch + 1)


class BatchSamplerShard(BatchSampler):
    """Yields this process's batches of indices from ``batch_sampler``, in Accelerate's layout (module docstring).

    Args:
        batch_sampler: the original loader's batch sampler.
        num_processes: number of processes sharing the data.
        process_index: this process's rank.
        split_batches: cut each batch into ``num_processes`` pieces instead of dealing whole batches.
        even_batches: complete the last round with samples from the start of the epoch.
    """

    def __init__(
        self,
        batch_sampler,
        num_processes: int = 1,
        process_index: int = 0,
        split_batches: bool = False,
        even_batches: bool = True,
    ):
        self.batch_sampler = batch_sampler
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches
        self.even_batches = even_batches
        self.batch_size = getattr(batch_sampler, "batch_size", None)
        self.drop_last = getattr(batch_sampler, "drop_last", False)
        if split_batches and (self.batch_size is None or self.batch_size % num_processes != 0):
            raise ConfigError(
                f"split_batches=True cuts each batch into {num_processes} pieces, so it needs a batch sampler with a "
                f"batch_size divisible by {num_processes}; got batch_size={self.batch_size} from "
                f"{type(batch_sampler).__name__}. Use a batch size that is a round multiple of {num_processes}, or "
                "split_batches=False."
            )
        self.final_round: FinalRound | None = None
        self._skip = 0
        self._skip_samples = 0
        self._skipped_rounds = 0
        self._ledger = SampleLedger()

    def skip_next_iteration(self, num_batches: int = 0, samples: int = 0) -> None:
        """Make the next iteration start at this process's batch ``num_batches``, or after the first ``samples``
        samples of the epoch's global order (index lists only: no data is loaded)."""
        self._skip = int(num_batches)
        self._skip_samples = int(samples)

    def samples_after(self, batches: int) -> int:
        """Samples of the epoch's global order consumed once this process has had ``batches`` batches of this
        iteration (counted after the skip): the loader's position, the same number on every process."""
        return self._ledger.after(self._skipped_rounds + batches)

    @property
    def sampler(self):
        """The sampler of the wrapped batch sampler (so ``loader.batch_sampler.sampler`` keeps working)."""
        return getattr(self.batch_sampler, "sampler", None)

    def __len__(self) -> int:
        length = len(self.batch_sampler)
        if self.split_batches:
            return length
        full, leftover = divmod(length, self.num_processes)
        if self.drop_last or leftover == 0:
            return full
        if self.even_batches:
            return full + 1
        return full + (1 if self.process_index < leftover else 0)

    @property
    def rounds(self) -> int:
        """Rounds in an epoch, the same on every rank (a rank may have no batch in the last one)."""
        length = len(self.batch_sampler)
        if self.split_batches:
            return length
        return length // self.num_processes if self.drop_last else math.ceil(length / self.num_processes)

    @property
    def total_length(self) -> int:
        """Number of batches of the wrapped batch sampler."""
        return len(self.batch_sampler)

    def __iter__(self) -> Iterator[list[int]]:
        self.final_round = None
        skip, self._skip = self._skip, 0
        samples, self._skip_samples = self._skip_samples, 0
        self._skipped_rounds = skip
        self._ledger.reset(0)
        head: list = []  # the epoch's first batches among the skipped ones: what completes the last round
        keep = 1 if self.split_batches else self.num_processes

        def seen(batch) -> None:
            if len(head) < keep:
                head.append(batch)

        batches = iter(self.batch_sampler)
        if samples:  # skip now: the layouts read ``head`` when they start
            batches = skip_samples(batches, samples, len, seen, self._ledger.reset, self.process_index == 0)
            batches = itertools.chain(list(itertools.islice(batches, 1)), batches)
        yield from itertools.islice(self._own_batches(_Drawn(batches), head), skip, None)

    def _own_batches(self, source: _Drawn, head: list) -> Iterator[list[int]]:
        """This rank's batches of the rounds laid out from ``source`` (``head``: the epoch's skipped first batches),
        each round's samples recorded in the ledger."""
        rank = self.process_index
        layout = _split_layout(self, source, head) if self.split_batches else _round_robin_layout(self, source, head)
        last: tuple[list[int], ...] = ()
        for pieces in layout:
            if isinstance(pieces, _Tail):
                self.final_round = pieces.final_round(last)
                for depth in range(max(len(b) for b in pieces.batches)):  # a rank may get 2 batches (varying sizes)
                    self._ledger.add(source.take() if depth == 0 else 0)
                yield from pieces.batches[rank]
                return
            self._ledger.add(source.take())
            last = pieces
            yield pieces[rank]
        if last:
            sizes = tuple(len(p) for p in last)
            self.final_round = FinalRound(sum(sizes), sizes, padded=False)


class PassThroughBatchSampler(BatchSamplerShard):
    """The batch sampler of a loader prepared for one process: the user's batches, unchanged.

    Accelerate does not shard a loader of one process (a :class:`BatchSamplerShard` of one process would
    complete a short last batch); hasten keeps this wrapper so that the loader can still start an
    iteration at any batch without loading the ones before it. ``split_batches`` and ``even_batches`` are
    recorded (the loader reports them) and change nothing.
    """

    def __init__(self, batch_sampler, split_batches: bool = False, even_batches: bool = True):
        super().__init__(batch_sampler, 1, 0, split_batches=split_batches, even_batches=even_batches)

    def __len__(self) -> int:
        return len(self.batch_sampler)

    @property
    def rounds(self) -> int:
        """Batches in an epoch."""
        return len(self.batch_sampler)

    def _own_batches(self, source: _Drawn, head: list) -> Iterator[list[int]]:
        last = None
        for batch in source:
            self._ledger.add(source.take())
            last = batch
            yield batch
        if last is not None:
            self.final_round = FinalRound(len(last), (len(last),), padded=False)


class _Drawn:
    """An iterator of batches that counts the samples drawn from it, so that a layout's rounds can be counted in
    samples of the order (a round a layout does not give out is counted with the next one)."""

    def __init__(self, batches: Iterator) -> None:
        self._batches = batches
        self._drawn = 0

    def __iter__(self) -> _Drawn:
        return self

    def __next__(self):
        batch = next(self._batches)
        self._drawn += len(batch)
        return batch

    def take(self) -> int:
        """Samples drawn since the last call."""
        drawn, self._drawn = self._drawn, 0
        return drawn


@dataclass
class _Tail:
    """What each rank gets after the last complete round: ``batches[r]``, of which ``real[r]`` samples are genuine."""

    batches: list[list]
    real: list[list[int]]

    @classmethod
    def empty(cls, world: int) -> _Tail:
        return cls([[] for _ in range(world)], [[] for _ in range(world)])

    def add(self, rank: int, batch, real: int) -> None:
        self.batches[rank].append(batch)
        self.real[rank].append(real)

    def final_round(self, last_round: tuple) -> FinalRound | None:
        """The layout of the epoch's last round, or None when it is not one batch (or none) per rank with the
        genuine samples first in rank order (a batch sampler whose batch sizes vary can give that)."""
        if not any(self.batches):
            sizes = tuple(len(b) for b in last_round)
            return FinalRound(sum(sizes), sizes, padded=False) if last_round else None
        if any(len(b) > 1 for b in self.batches):
            return None
        sizes = tuple(len(b[0]) if b else 0 for b in self.batches)
        reals = [r[0] if r else 0 for r in self.real]
        total, before = sum(reals), 0
        for size, real in zip(sizes, reals):
            if real != min(size, max(0, total - before)):
                return None
            before += size
        return FinalRound(total, sizes, padded=total != sum(sizes))


def _round_robin_layout(shard: BatchSamplerShard, source: Iterator, head: list):
    """Accelerate's round-robin layout of ``source``: batch ``i`` to rank ``i % N``, one tuple per complete round,
    then a :class:`_Tail` completed from the epoch's first ``N`` batches (``head``: the skipped ones among them). A
    round whose last batch is short (with a fixed ``batch_size``) is not given out."""
    world, size, drop_last = shard.num_processes, shard.batch_size, shard.drop_last
    pending: list = [None] * world
    first: list = []
    for batch in head if not drop_last else ():
        _add_first(first, batch, size)
    last, count = None, 0
    for index, batch in enumerate(source):
        count = index + 1
        if not drop_last and len(head) + index < world:
            _add_first(first, batch, size)
        pending[index % world] = batch
        if index % world == world - 1 and (size is None or len(batch) == size):
            yield tuple(pending)
            pending = [None] * world
        last = batch
    if drop_last or last is None:
        return
    tail = _Tail.empty(world)
    for rank, batch in enumerate(pending):
        if batch and (not shard.even_batches or size is None or len(batch) == size):
            tail.add(rank, batch, len(batch))
    if shard.even_batches:
        _complete_last_round(tail, first, last, count - 1, world, size)
    yield tail


def _add_first(first: list, batch, size: int | None) -> None:
    """Keep ``batch`` among the epoch's first ones: whole without a fixed batch size, else its samples."""
    if size is None:
        first.append(batch)
    else:
        first.extend(batch)


def _complete_last_round(tail: _Tail, first: list, last, index: int, world: int, size: int | None) -> None:
    """``even_batches``: give the ranks after the last batch (and the short last batch) samples from the start."""
    pool = first
    while len(pool) < (world * size if size is not None else world):
        pool = pool + pool
    batch = last
    if size is None or len(batch) == size:
        batch, index = [], index + 1
    cursor = 0
    while index % world != 0 or len(batch) > 0:
        if size is None:
            tail.add(index % world, pool[cursor], 0)
            cursor += 1
        else:
            end = cursor + size - len(batch)
            tail.add(index % world, batch + pool[cursor:end], len(batch))
            cursor = end
        batch, index = [], index + 1


def _split_layout(shard: BatchSamplerShard, source: Iterator, head: list):
    """Accelerate's ``split_batches`` layout of ``source``: every full batch cut into ``N`` pieces, then a
    :class:`_Tail` for a short last batch, completed from the epoch's first batch (``head[0]`` when it was
    skipped). A short batch before the last is not given out."""
    world, size = shard.num_processes, shard.batch_size
    piece = size // world
    first, last = (head[0] if head else None), None
    for batch in source:
        if first is None:
            first = batch
        if len(batch) == size:
            yield tuple(batch[piece * r : piece * (r + 1)] for r in range(world))
        last = batch
    if shard.drop_last or last is None or len(last) >= size:
        return
    tail = _Tail.empty(world)
    if shard.even_batches:
        pool = first
        while len(pool) < size:
            pool = pool + pool
        full = last + pool
        for rank in range(world):
            tail.add(rank, full[piece * rank : piece * (rank + 1)], max(0, min(piece, len(last) - piece * rank)))
    else:
        for rank in range(world):
            if len(last) > piece * rank:
                mine = last[piece * rank : piece * (rank + 1)]
                tail.add(rank, mine, len(mine))
    yield tail


class IterableDatasetShard(IterableDataset):
    """Shards an ``IterableDataset`` between processes by reading it whole on every process.

    Samples are read in buffers of ``batch_size * num_processes`` (or ``batch_size`` with
    ``split_batches``); each process keeps its slice. Unless ``drop_last``, the last buffer is completed
    with samples from the first one, as in Accelerate (also with one process); :attr:`final_round` records
    how many samples are real so that ``gather_for_metrics`` drops the others.

    ``batch_size=None`` is for datasets that yield whole batches (a ``DataLoader(batch_size=None)``):
    each element goes to one process, in turn (Accelerate fails on it). With ``split_batches`` the batch
    size must be a multiple of ``num_processes``; unlike Accelerate, a batch size of 1 (which would give
    every process nothing) and ``None`` are refused too.
    """

    def __init__(
        self,
        dataset,
        batch_size: int | None = 1,
        drop_last: bool = False,
        num_processes: int = 1,
        process_index: int = 0,
        split_batches: bool = False,
    ):
        if split_batches and (batch_size is None or batch_size % num_processes != 0):
            raise ConfigError(
                f"split_batches=True cuts each batch into {num_processes} pieces, so IterableDatasetShard needs a "
                f"batch_size divisible by {num_processes}; got {batch_size}. Use a multiple of {num_processes}, or "
                "split_batches=False."
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches
        self.epoch = 0
        self.final_round: FinalRound | None = None
        self._skip_samples = 0
        self._ledger = SampleLedger()

    def set_epoch(self, epoch: int) -> None:
        """Record the epoch and forward it to the wrapped dataset when it supports it."""
        self.epoch = epoch
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def skip_next_iteration(self, num_batches: int = 0, samples: int = 0) -> None:
        """Make the next iteration start at this process's batch ``num_batches``, or after the first ``samples``
        samples of the dataset (read and dropped: a stream cannot seek)."""
        per_round = self._size if self.split_batches else self._size * self.num_processes
        self._skip_samples = int(samples) + int(num_batches) * per_round

    def samples_after(self, batches: int) -> int:
        """Samples of the dataset consumed once this process has had ``batches`` batches of this iteration (counted
        after the skip): the loader's position, the same number on every process."""
        return self._ledger.after(batches)

    @property
    def _size(self) -> int:
        return 1 if self.batch_size is None else self.batch_size

    def __len__(self) -> int:
        """Accelerate's count: ``batch_size`` samples per round of ``batch_size * num_processes`` samples (also with
        ``split_batches``, where a process really gets ``batch_size / num_processes`` per round)."""
        per_round = self._size * self.num_processes
        rounds = len(self.dataset) // per_round if self.drop_last else math.ceil(len(self.dataset) / per_round)
        return rounds * self._size

    def __iter__(self):
        generator = getattr(self.dataset, "generator", None)
        if not hasattr(self.dataset, "set_epoch") and isinstance(generator, torch.Generator):
            generator.manual_seed(self.epoch)  # as Accelerate does: the dataset's shuffling follows the epoch
        self.final_round = None
        n, rank = self.num_processes, self.process_index
        per_round = self._size if self.split_batches else self._size * n
        local = per_round // n
        mine = slice(rank * local, (rank + 1) * local)
        skip, self._skip_samples = self._skip_samples, 0
        self._ledger.reset(skip)
        first: list = []  # the epoch's first buffer (skipped samples too): what completes the last one
        buffer: list = []
        for sample in self.dataset:
            if len(first) < per_round:
                first.append(sample)
            if skip:
                skip -= 1
                continue
            buffer.append(sample)
            if len(buffer) == per_round:
                self._ledger.add(per_round)
                yield from buffer[mine]
                buffer = []
        if self.drop_last or not buffer:
            self.final_round = FinalRound(per_round, (local,) * n, padded=False) if len(first) == per_round else None
            return
        self._ledger.add(len(buffer))
        real = len(buffer)
        while len(buffer) < per_round:
            buffer += first
        self.final_round = FinalRound(real, (local,) * n, padded=True)
        yield from buffer[mine]


class SkipBatchSampler(BatchSampler):
    """Yields the batches of ``batch_sampler`` after skipping the first ``skip_batches``."""

    def __init__(self, batch_sampler, skip_batches: int = 0):
        self.batch_sampler = batch_sampler
        self.skip_batches = skip_batches

    @property
    def sampler(self):
        """The wrapped batch sampler's sampler."""
        return getattr(self.batch_sampler, "sampler", None)

    @property
    def batch_size(self):
        """The wrapped batch sampler's batch size (None if it has none), so that the loader can be prepared."""
        return getattr(self.batch_sampler, "batch_size", None)

    @property
    def drop_last(self) -> bool:
        """Whether the wrapped batch sampler drops its last incomplete batch."""
        return getattr(self.batch_sampler, "drop_last", False)

    def __iter__(self):
        yield from itertools.islice(iter(self.batch_sampler), self.skip_batches, None)

    @property
    def total_length(self) -> int:
        """Length of the wrapped batch sampler."""
        return len(self.batch_sampler)

    def __len__(self) -> int:
        return max(len(self.batch_sampler) - self.skip_batches, 0)


def get_sampler(dataloader) -> Sampler | None:
    """The sampler inside ``dataloader``'s batch sampler (or inside the ``BatchSampler`` given as its ``sampler``
    with ``batch_size=None``); None when that batch sampler has none, as in Accelerate."""
    if isinstance(getattr(dataloader, "sampler", None), BatchSampler):
        return getattr(dataloader.sampler, "sampler", None)
    return getattr(getattr(dataloader, "batch_sampler", None), "sampler", None)
