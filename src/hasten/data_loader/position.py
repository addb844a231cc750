"""Where a prepared loader stands in its epoch, counted in samples of the epoch's global order.

The global order is the sequence of batches the user's loader yields (its batch sampler over its
sampler, or its iterable dataset): the same on every process and, for a seeded sampler, the same for
any number of processes, because it depends only on the seed and the epoch. The processes consume it
together, a round at a time (``N`` batches dealt round-robin, or one batch cut in ``N`` pieces), so
"``S`` samples of the order are consumed" means the same thing on 2 processes as on 4, whereas "3
batches per process" does not. A loader saved on ``N`` processes and resumed on ``M`` skips exactly
the ``S`` samples its state records and deals the rest between the ``M`` processes.

Padding is not consumption: the samples repeated to complete the last round (``even_batches``) are
not counted, so the position after the last round is the number of real samples in the epoch.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from ..state import warn_once


class SampleLedger:
    """Samples of the global order consumed once each round of an iteration is handed out.

    A shard records each round as it produces it (:meth:`add`); the loader, which runs a few rounds
    behind the shard (it looks one batch ahead, and worker processes prefetch), asks for the count
    after the rounds it has really handed out (:meth:`after`). Rounds usually have the same size, so
    only the rounds of another size are recorded: constant memory for a fixed batch size.
    """

    def __init__(self) -> None:
        self.reset(0)

    def reset(self, start: int) -> None:
        """Start an iteration whose first round follows the first ``start`` samples of the order."""
        self.start = start
        self._rounds = 0
        self._total = start
        self._usual: int | None = None
        self._marks: list[int] = []  # round counts after which the total is not start + count * usual
        self._totals: list[int] = []

    def add(self, samples: int) -> None:
        """Record one more round holding ``samples`` real samples (padding excluded)."""
        if self._usual is None:
            self._usual = samples
        self._rounds += 1
        self._total += samples
        if samples != self._usual:
            self._marks.append(self._rounds)
            self._totals.append(self._total)

    def after(self, rounds: int) -> int:
        """Samples of the order consumed once the first ``rounds`` rounds of this iteration are."""
        rounds = min(rounds, self._rounds)
        i = bisect_right(self._marks, rounds) - 1
        if i < 0:
            return self.start + rounds * (self._usual or 0)
        return self._totals[i] + (rounds - self._marks[i]) * (self._usual or 0)


def skip_samples(
    batches: Iterator,
    samples: int,
    size: Callable[[Any], int],
    seen: Callable[[Any], None],
    start: Callable[[int], None],
    is_main: bool,
) -> Iterator:
    """The batches of ``batches`` that follow the first ``samples`` samples of the order.

    Skipped batches are passed to ``seen`` (a shard keeps the epoch's first samples, to complete its
    last round with). Once the first remaining batch is drawn (or the source ran out), ``start`` gets
    the number of samples really skipped: a position that falls inside a batch (the loader's batch
    size changed since the save) resumes at that batch's start, which repeats some samples, and the
    main process says how many.
    """
    consumed = 0
    for batch in batches:
        count = size(batch)
        if consumed + count > samples:
            if consumed < samples and is_main:
                warn_once(
                    "resume-inside-batch",
                    f"The resumed loader position ({samples} samples into the epoch) falls inside a batch of this "
                    "run's loader (its batch size differs from the saved run's): that batch is trained on whole, so "
                    f"{samples - consumed} samples of it are seen twice. Keep the loader's batch size to resume "
                    "exactly.",
                )
            start(consumed)
            yield batch
            yield from batches
            return
        seen(batch)
        consumed += count
    start(consumed)


def rows_in(batch) -> int:
    """Samples in a collated batch: the first dimension of its first tensor (or the length of its first list)."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.ndim else 1
    if isinstance(batch, Mapping):
        return rows_in(next(iter(batch.values())))
    if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], (torch.Tensor, Mapping, list, tuple)):
        return rows_in(batch[0])
    return len(batch) if isinstance(batch, (list, tuple)) else 1
