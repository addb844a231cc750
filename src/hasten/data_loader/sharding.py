"""How a dataset's batches are split between processes.

The layout is deterministic and the same on every rank, so each rank knows what the others get:
batches go round-robin (batch ``i`` to rank ``i % N``), or, with ``split_batches``, every batch is cut
into ``N`` contiguous pieces. Only the last *round* (the final ``N`` batches, or the final batch when
splitting) can be incomplete:

* ``even_batches=True``: the round is completed with samples from the start of the epoch, so every
  rank gets a full batch; :class:`FinalRound` records how many samples are real so that
  ``gather_for_metrics`` drops the duplicates.
* ``even_batches=False``: nothing is duplicated and the last round keeps Accelerate's layout: the
  leftover batches go to the first ranks (with ``split_batches``, the last batch is cut into pieces of
  the usual size from rank 0 on), and a rank with nothing left gets no batch, so its loop ends one
  step earlier. A training loop then needs ``accelerator.join_uneven_inputs`` (DDP), as in Accelerate;
  ``gather_for_metrics`` after the loop still returns the dataset exactly.

A ``drop_last=True`` loader drops an incomplete last round, as in Accelerate.
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


def split_evenly(items: list, parts: int) -> list[list]:
    """Split ``items`` into ``parts`` contiguous lists whose lengths differ by at most one (first ones longer)."""
    base, extra = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        out.append(items[start:end])
        start = end
    return out


def _cycle(first: list, count: int) -> list:
    return list(itertools.islice(itertools.cycle(first), count)) if first else []


class SeedableRandomSampler(RandomSampler):
    """A ``RandomSampler`` whose order depends only on ``seed + epoch``.

    Every rank with the same seed draws the same permutation, and a resumed run reproduces the epoch's
    order exactly. The seed is ``data_seed``, else the global torch seed (``torch.initial_seed()``, what
    ``set_seed`` sets), as in Accelerate. The epoch advances after each full pass; prepared loaders set
    it at each epoch start (:meth:`set_epoch`).
    """

    def __init__(self, data_source, replacement: bool = False, num_samples: int | None = None, generator=None, data_seed: int | None = None):
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
    """Yields this process's batches of indices from ``batch_sampler`` (see the module docstring).

    Args:
        batch_sampler: the original loader's batch sampler.
        num_processes: number of processes sharing the data.
        process_index: this process's rank.
        split_batches: cut each batch into ``num_processes`` pieces instead of dealing whole batches.
        even_batches: complete the last round with samples from the start of the epoch.
    """

    def __init__(self, batch_sampler, num_processes: int = 1, process_index: int = 0, split_batches: bool = False, even_batches: bool = True):
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
                f"{type(batch_sampler).__name__}. Use a batch size that is a multiple of {num_processes}, or split_batches=False."
            )
        self.final_round: FinalRound | None = None
        self._last_round: list[list[int]] = []
        self._first: list[int] = []
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
        self._last_round = []
        self._first = []
        self._ledger.reset(0)
        skip, self._skip = self._skip, 0
        samples, self._skip_samples = self._skip_samples, 0
        self._skipped_rounds = skip
        source = (list(batch) for batch in self.batch_sampler)
        if samples:
            source = skip_samples(source, samples, len, self._remember, self._ledger.reset, self.process_index == 0)
        batches = self._iter_split(source) if self.split_batches else self._iter_rounds(source)
        yield from itertools.islice(batches, skip, None)

    def _remember(self, batch: list[int]) -> None:
        """Keep the epoch's first samples (skipped ones too): what completes an incomplete last round."""
        if len(self._first) < (self.batch_size or len(batch)) * (1 if self.split_batches else self.num_processes):
            self._first.extend(batch)

    def _iter_rounds(self, source: Iterator[list[int]]) -> Iterator[list[int]]:
        n, rank = self.num_processes, self.process_index
        round_: list[list[int]] = []
        for batch in source:
            self._remember(batch)
            round_.append(batch)
            if len(round_) == n and (self.batch_size is None or len(batch) == self.batch_size):
                self._last_round = round_
                self._ledger.add(sum(len(b) for b in round_))
                yield round_[rank]
                round_ = []
        if round_ and not self.drop_last:
            mine = self._finish_round(round_, self._first)
            if mine is not None:
                yield mine
        elif self._last_round:  # the epoch ended on a complete round (or the incomplete one was dropped)
            sizes = tuple(len(b) for b in self._last_round)
            self.final_round = FinalRound(sum(sizes), sizes, padded=False)

    def _finish_round(self, round_: list[list[int]], first: list[int]) -> list[int] | None:
        """This rank's batch of the incomplete last round (None: it has none, ``even_batches=False``)."""
        n = self.num_processes
        leftover = [i for batch in round_ for i in batch]
        self._ledger.add(len(leftover))
        if self.even_batches and n > 1:
            size = self.batch_size or max(len(b) for b in round_)
            full = leftover + _cycle(first, n * size - len(leftover))
            chunks = [full[k * size : (k + 1) * size] for k in range(n)]
            self.final_round = FinalRound(len(leftover), (size,) * n, padded=True)
            return chunks[self.process_index]
        chunks = round_ + [[]] * (n - len(round_))
        self.final_round = FinalRound(len(leftover), tuple(len(c) for c in chunks), padded=False)
        return chunks[self.process_index] if self.process_index < len(round_) else None

    def _iter_split(self, source: Iterator[list[int]]) -> Iterator[list[int]]:
        n, rank = self.num_processes, self.process_index
        last: list[int] = []
        for batch in source:
            self._remember(batch)
            self._ledger.add(len(batch))
            full_size = self.batch_size or len(batch)
            if len(batch) == full_size and full_size % n == 0:
                piece = full_size // n
                last = batch
                yield batch[rank * piece : (rank + 1) * piece]
                continue
            if self.even_batches and n > 1:
                target = math.ceil(max(full_size, len(batch)) / n) * n
                padded = batch + _cycle(self._first, target - len(batch))
                piece = target // n
                self.final_round = FinalRound(len(batch), (piece,) * n, padded=True)
                yield padded[rank * piece : (rank + 1) * piece]
            else:
                piece = full_size // n
                chunks = [batch[k * piece : (k + 1) * piece] for k in range(n)]
                self.final_round = FinalRound(len(batch), tuple(len(c) for c in chunks), padded=False)
                if chunks[rank]:
                    yield chunks[rank]
            return
        if last:
            piece = len(last) // n
            self.final_round = FinalRound(len(last), (piece,) * n, padded=False)


class IterableDatasetShard(IterableDataset):
    """Shards an ``IterableDataset`` between processes by reading it whole on every process.

    Samples are read in buffers of ``batch_size * num_processes`` (or ``batch_size`` with
    ``split_batches``); each process keeps its slice. The last buffer is completed with samples from
    the start (``even_batches``, the default) or split as evenly as possible; when fewer samples than
    processes remain, it is completed in both modes so no process runs one batch short.

    ``batch_size=None`` is for datasets that yield whole batches (a ``DataLoader(batch_size=None)``):
    each element goes to one process, in turn. With ``split_batches`` the batch size must be a multiple
    of ``num_processes``; unlike Accelerate, a batch size of 1 (which would give every process nothing)
    and ``None`` are refused too.
    """

    def __init__(self, dataset, batch_size: int | None = 1, drop_last: bool = False, num_processes: int = 1, process_index: int = 0, split_batches: bool = False, even_batches: bool = True):
        if split_batches and (batch_size is None or batch_size % num_processes != 0):
            raise ConfigError(
                f"split_batches=True cuts each batch into {num_processes} pieces, so IterableDatasetShard needs a batch_size "
                f"divisible by {num_processes}; got {batch_size}. Use a multiple of {num_processes}, or split_batches=False."
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches
        self.even_batches = even_batches
        self.final_round: FinalRound | None = None
        self._skip_samples = 0
        self._ledger = SampleLedger()

    def set_epoch(self, epoch: int) -> None:
        """Forward the epoch to the wrapped dataset when it supports it."""
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
        total = len(self.dataset)
        per_round = self._size if self.split_batches else self._size * self.num_processes
        rounds = total // per_round if self.drop_last else math.ceil(total / per_round)
        local = self._size // self.num_processes if self.split_batches else self._size
        return rounds * local

    def __iter__(self):
        self.final_round = None
        n, rank = self.num_processes, self.process_index
        per_round = self._size if self.split_batches else self._size * n
        local = per_round // n
        skip, self._skip_samples = self._skip_samples, 0
        self._ledger.reset(skip)
        first: list = []
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
                yield from buffer[rank * local : (rank + 1) * local]
                buffer = []
        if not buffer or self.drop_last:
            if not buffer:
                self.final_round = FinalRound(per_round, (local,) * n, padded=False) if first else None
            return
        self._ledger.add(len(buffer))
        if n > 1 and (self.even_batches or len(buffer) < n):
            real = len(buffer)
            buffer = buffer + _cycle(first, per_round - len(buffer))
            self.final_round = FinalRound(real, (local,) * n, padded=True)
            yield from buffer[rank * local : (rank + 1) * local]
        else:
            chunks = split_evenly(buffer, n)
            self.final_round = FinalRound(len(buffer), tuple(len(c) for c in chunks), padded=False)
            yield from chunks[rank]


class SkipBatchSampler(BatchSampler):
    """Yields the batches of ``batch_sampler`` after skipping the first ``skip_batches``."""

    def __init__(self, batch_sampler, skip_batches: int = 0):
        self.batch_sampler = batch_sampler
        self.skip_batches = skip_batches

    @property
    def sampler(self):
        """The wrapped batch sampler's sampler."""
        return getattr(self.batch_sampler, "sampler", None)

    def __iter__(self):
        yield from itertools.islice(iter(self.batch_sampler), self.skip_batches, None)

    @property
    def total_length(self) -> int:
        """Length of the wrapped batch sampler."""
        return len(self.batch_sampler)

    def __len__(self) -> int:
        return max(len(self.batch_sampler) - self.skip_batches, 0)


def get_sampler(dataloader) -> Sampler | None:
    """The sampler that orders ``dataloader``'s samples (through its batch sampler when there is one, also when
    the ``sampler`` argument itself is a ``BatchSampler`` with ``batch_size=None``)."""
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    if batch_sampler is None and isinstance(getattr(dataloader, "sampler", None), BatchSampler):
        batch_sampler = dataloader.sampler
    sampler = getattr(batch_sampler, "sampler", None)
    return sampler if sampler is not None else getattr(dataloader, "sampler", None)
