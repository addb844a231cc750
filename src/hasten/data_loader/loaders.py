"""Prepared dataloaders: sharded (:class:`DataLoaderShard`; the one dispatched from rank 0 is in ``dispatcher.py``).

Both look one batch ahead so that ``end_of_dataloader`` is known while the last batch is processed
(gradient accumulation forces a sync there; ``gather_for_metrics`` drops padded samples there), both
know their position (epoch, samples of the epoch's global order consumed, and how the epoch's random
draws started) so ``save_state``/``load_state`` can resume mid-epoch, also on another number of
processes, and both place batches on the process's device.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader

from ..errors import ConfigError
from ..runtime import preemption
from ..runtime.rng import broadcast_rng_state, broadcast_rng_states
from ..runtime.tree import send_to_device
from ..state import PROCESS_STATE, GradientState, warn_once
from .epoch_rng import EpochStart
from .position import rows_in, skip_samples
from .sharding import (
    BatchSamplerShard,
    FinalRound,
    IterableDatasetShard,
    SeedableRandomSampler,
    get_sampler,
)

_END = object()  # what next() returns when an iterator is exhausted (a batch may itself be None)

# DataLoader arguments copied from the user's loader to the prepared one.
_LOADER_ARGS = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "prefetch_factor",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
)


def _loader_kwargs(dataloader: DataLoader) -> dict[str, Any]:
    kwargs = {}
    for name in _LOADER_ARGS:
        if hasattr(dataloader, name):
            kwargs[name] = getattr(dataloader, name)
    if kwargs.get("num_workers", 0) == 0:
        kwargs.pop("prefetch_factor", None)
        kwargs.pop("persistent_workers", None)
    return kwargs


class _ItselfOnInstances:
    """``base_dataloader``: Accelerate's loaders wrap a ``DataLoader`` there; hasten's are ``DataLoader`` subclasses,
    so a loader's base is the loader itself. Read on a class, it is an ``AttributeError``, as Accelerate's is."""

    def __get__(self, loader, owner=None):
        if loader is None:
            raise AttributeError(f"base_dataloader belongs to a {owner.__name__} instance, not to the class")
        return loader


class DataLoaderStateMixin:
    """Tracks the epoch, the position inside it and the end of the data, and registers with :class:`GradientState`.

    The position is kept in samples of the epoch's global order (see :mod:`.position`), so a state saved
    on N processes resumes on M. A state saved inside the loop after the epoch's last batch resumes with
    that epoch's remaining zero batches: the next iteration yields nothing and ends the epoch, as the
    uninterrupted run's loop would have seen. A state saved after the iteration ended resumes with the
    next epoch. The state also holds how the epoch's random draws started (:mod:`.epoch_rng`): a resumed
    epoch replays them instead of drawing again, so it runs in the uninterrupted epoch's order.
    """

    base_dataloader = _ItselfOnInstances()
    use_stateful_dataloader = False  # Accelerate's attribute; prepare_data_loader records the value it was given

    def _init_state(self, process, gradient_state) -> None:
        """Start at epoch 0, for ``process`` (the process state: the device, the main process) and ``gradient_state``:
        the Accelerator hands in its own; a loader built without them (None) uses the process's, as Accelerate's do."""
        self._process = process if process is not None else PROCESS_STATE
        self.gradient_state = gradient_state if gradient_state is not None else GradientState()
        self.end_of_dataloader = False
        self.iteration = 0
        self.remainder = -1
        self._yielded = 0  # batches handed out by the running iteration, after its skip
        self._skipped = 0  # this process's batches that the running iteration's skip stood for
        self._active = False
        self._resume: dict[str, Any] | None = None  # where the next iteration starts: {"batches"} or {"samples"}
        self._epoch_start: EpochStart | None = None  # the generators' states the running epoch started from
        self._replay: tuple[int, EpochStart] | None = None  # (epoch, states) that epoch starts from when resumed
        self._restarted: tuple[int, int] | None = None  # (epoch, batches) a default load_state restored mid-epoch

    @property
    def final_round(self) -> FinalRound | None:
        """Layout of the last round of the current epoch, once it is known."""
        return None

    def begin(self) -> None:
        """Mark the start of an iteration and register as the active dataloader.

        ``remainder`` is Accelerate's: for a sharded loader, the dataset's length modulo the total batch size
        (-1 with ``drop_last`` or when either is unknown); ``gather_for_metrics`` on one process truncates to it.
        """
        self.end_of_dataloader = False
        self.remainder = self._initial_remainder()
        self.gradient_state._add_dataloader(self)

    def _initial_remainder(self) -> int:
        return -1

    def end(self) -> None:
        """Unregister at the end of an iteration."""
        self.gradient_state._remove_dataloader(self)

    def set_epoch(self, epoch: int) -> None:
        """Start the next iteration at epoch ``epoch``; tells the batch sampler, sampler and dataset that have
        ``set_epoch``.

        A position restored by ``load_state_dict`` for another epoch is dropped: the loop has moved on.
        """
        if self._resume is not None and epoch != self.iteration:
            self._resume = None
        self.iteration = epoch
        self._propagate_epoch()

    def _propagate_epoch(self) -> None:
        batch_sampler = getattr(self, "batch_sampler", None)
        own = batch_sampler.batch_sampler if isinstance(batch_sampler, BatchSamplerShard) else batch_sampler
        seen: set[int] = set()
        for target in (own, get_sampler(self), getattr(self, "dataset", None)):
            if hasattr(target, "set_epoch") and id(target) not in seen:
                seen.add(id(target))
                target.set_epoch(self.iteration)

    def _process_count(self) -> int:
        """Processes sharing this loader's data."""
        return 1

    @property
    def _counts_samples(self) -> bool:
        """True when the loader knows its position in samples of the global order (not when the user's own
        sampler or dataset shards the data)."""
        return False

    def _samples_consumed(self) -> int:
        """Samples of the global order the running iteration has consumed (meaningful when :attr:`_counts_samples`)."""
        return 0

    def _per_round(self) -> int | None:
        """Samples of the global order a full round consumes (None: unknown, e.g. no fixed batch size)."""
        return None

    def state_dict(self) -> dict[str, Any]:
        """Position of this loader (JSON-compatible).

        ``epoch``; ``samples``: samples of the epoch's global order consumed by every process together
        (absent when the loader is sharded by the user's own sampler); ``batches_yielded``: this process's
        batches of the epoch; ``end_of_epoch``: the epoch's last batch was handed out; ``num_processes``;
        ``seed``, the seedable sampler's seed; ``rng``: inside an epoch, the generators' states it started
        from; between epochs, the states the next epoch starts its own generators from (:mod:`.epoch_rng`).
        """
        if self._resume is not None and "state" in self._resume:
            return dict(self._resume["state"])
        batches, samples, end = 0, 0, False
        if self._resume is not None:  # skip_first_batches, before the iteration started
            batches = self._resume["batches"]
            per_round = self._per_round()
            samples = batches * per_round if per_round else None
        elif self._active:
            batches, samples, end = self._skipped + self._yielded, self._samples_consumed(), self.end_of_dataloader
        state: dict[str, Any] = {"epoch": self.iteration, "batches_yielded": batches, "end_of_epoch": end}
        state["num_processes"] = self._process_count()
        if samples is not None and self._counts_samples:
            state["samples"] = samples
        sampler = get_sampler(self)
        if isinstance(sampler, SeedableRandomSampler):
            state["seed"] = sampler.initial_seed
        state["rng"] = self._random_start(mid_epoch=self._active and not end).to_json()
        return state

    def _random_start(self, mid_epoch: bool) -> EpochStart:
        """The generators' states a resume starts from: inside an epoch, those the epoch started from; otherwise
        those the next epoch was given by a resume, or else the loader's own generators' current states (the
        checkpoint restores the global one, which the next epoch then draws from as the uninterrupted run does)."""
        if mid_epoch and self._epoch_start is not None:
            return self._epoch_start
        if self._replay is not None and self._replay[0] == self.iteration:
            return self._replay[1]
        return EpochStart.capture(self, with_global=False)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at the position saved by :meth:`state_dict`, also on another number of processes: the next
        iteration continues that epoch (with zero batches when the save followed the epoch's last batch)."""
        self._restore_epoch_and_random_start(state, int(state["epoch"]))
        samples, batches = state.get("samples"), int(state.get("batches_yielded", 0))
        world = self._process_count()
        saved_world = state.get("num_processes", world)
        if samples is not None and self._counts_samples:
            per_round = self._per_round()
            skipped = batches if saved_world == world else (int(samples) // per_round if per_round else 0)
            self._resume = {"samples": int(samples), "skipped": skipped, "state": dict(state)}
        elif saved_world == world:
            self._resume = {"batches": batches, "state": dict(state)}
        else:
            warn_once(
                "unmappable-position",
                f"A dataloader was saved on {saved_world} processes at batch {batches} of epoch {state['epoch']} and "
                f"is resumed on {world}; it is sharded by its own sampler or dataset, so its position cannot be mapped "
                "to the new number of processes: it restarts that epoch from its first batch (samples already trained "
                "on are seen again).",
            )
            self._resume = None

    def restore_epoch(self, state: Mapping[str, Any]) -> None:
        """Restore the epoch, the seed and how the epoch started, saved by :meth:`state_dict`, not the position in it.

        The next iteration runs the saved epoch from its first batch, in the saved order (the next epoch when
        the save followed the epoch's last batch), so a loop that skips the batches it already trained on
        (``resume_step = step % len(loader)``, then ``skip_first_batches`` or ``if step < resume_step: continue``)
        sees the same data as the interrupted run. This is what ``load_state`` does unless
        ``DataLoaderConfiguration(use_stateful_dataloader=True)``.
        """
        self._restore_epoch_and_random_start(state, int(state["epoch"]) + (1 if state.get("end_of_epoch") else 0))
        self._resume = None
        batches = int(state.get("batches_yielded", 0))
        self._restarted = (self.iteration, batches) if batches and not state.get("end_of_epoch") else None

    def _restore_epoch_and_random_start(self, state: Mapping[str, Any], epoch: int) -> None:
        self.iteration = epoch
        sampler = get_sampler(self)
        if "seed" in state and isinstance(sampler, SeedableRandomSampler):
            sampler.initial_seed = int(state["seed"])
        start_of = int(state["epoch"]) + (1 if state.get("end_of_epoch") else 0)  # the epoch the saved states start
        self._replay = (start_of, EpochStart.from_json(state["rng"])) if state.get("rng") else None

    def skip_batches_next_epoch(self, num_batches: int) -> None:
        """Start the next iteration at batch ``num_batches`` of the current epoch (absolute, not cumulative)."""
        self._resume = {"batches": int(num_batches)}

    def _take_resume(self) -> tuple[int, int | None] | None:
        """Begin an iteration: (batches to skip, samples to skip or None), or None when the epoch has zero batches
        left (the iteration ends without drawing anything); resets the iteration's counters."""
        resume, self._resume = self._resume, None
        restarted, self._restarted = self._restarted, None
        restarts = resume is None and restarted is not None and restarted[0] == self.iteration
        if restarts and self._process.is_main_process:
            _warn_restart(*restarted)
        self._yielded, self._active = 0, True
        if resume is None:
            self._skipped = 0
            return 0, None
        if resume.get("state", {}).get("end_of_epoch"):
            self._skipped = int(resume["state"].get("batches_yielded", 0))
            return None
        if "samples" in resume:
            self._skipped = resume["skipped"]
            return 0, resume["samples"]
        self._skipped = resume["batches"]
        return resume["batches"], None

    @contextlib.contextmanager
    def _epoch_randomness(self) -> Iterator[None]:
        """Wrap the start of an epoch (creating the iterator, fetching the first batch): the generators start from
        the states a resume gave this epoch, if any, and the states it starts from are recorded (a copy, no draw)."""
        replay, self._replay = self._replay, None
        replayed = replay[1].replayed(self) if replay is not None and replay[0] == self.iteration else None
        with replayed or contextlib.nullcontext():
            self._epoch_start = EpochStart.capture(self)
            yield

    def _finish_epoch(self) -> None:
        """End the iteration; the next one is the next epoch unless this one had no batch at all (skipped ones
        count), as in Accelerate, whose loaders stay at the same epoch after an iteration with nothing to draw."""
        if self._yielded or self._skipped:
            self.iteration += 1
        self._yielded = self._skipped = 0
        self._active = False


def _warn_restart(epoch: int, batches: int) -> None:
    """Warn (on the main process) that a loader restarts the epoch a checkpoint recorded mid-way, at its first batch."""
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_globals.get("__name__", "").startswith("hasten."):
        frame, level = frame.f_back, level + 1  # up to the loop iterating the loader
    warnings.warn(
        f"A prepared dataloader starts epoch {epoch} at its first batch, but the checkpoint load_state restored was "
        f"saved after batch {batches} of that epoch: the loop trains on those batches again. To continue after them, "
        f"iterate accelerator.skip_first_batches(loader, {batches}) for this epoch (then the loader itself), or "
        "prepare with DataLoaderConfiguration(use_stateful_dataloader=True), with which load_state restores the "
        "position. A loop that skips them itself (`if step < resume_step: continue`) can use skip_first_batches "
        "instead, which does not load them.",
        UserWarning,
        stacklevel=level,
    )


@contextlib.contextmanager
def even_batches_overridden(loaders, even_batches: bool | None):
    """Context manager setting ``even_batches`` of the sharded :class:`DataLoaderShard` among ``loaders``.

    None leaves them as they are; the previous values come back on exit.
    """
    sharded = [loader for loader in loaders if isinstance(loader, DataLoaderShard) and loader.even_batches is not None]
    previous = [loader.even_batches for loader in sharded]
    if even_batches is not None:
        for loader in sharded:
            loader.even_batches = even_batches
    try:
        yield
    finally:
        for loader, value in zip(sharded, previous):
            loader.even_batches = value


def _dataset_length(dataset) -> int:
    length = getattr(dataset, "total_dataset_length", None)
    return len(dataset) if length is None else length


def _accelerate_total_batch_size(loader) -> int:
    """Accelerate's global batch size of a sharded loader, from its batch sampler (what its ``remainder`` uses)."""
    batch_sampler = loader.sampler if isinstance(loader.sampler, BatchSampler) else loader.batch_sampler
    if getattr(batch_sampler, "split_batches", False):
        return batch_sampler.batch_size
    return batch_sampler.batch_size * getattr(batch_sampler, "num_processes", 1)


class DataLoaderShard(DataLoaderStateMixin, DataLoader):
    """A ``DataLoader`` whose batches are this process's share, placed on ``device``.

    Built by :func:`prepare_data_loader`; the arguments are those of ``DataLoader`` plus:

    Args:
        device: where to put each batch (None leaves them where they are).
        rng_types: generators synchronised from rank 0 at the start of each epoch.
        synchronized_generator: the generator every rank shuffles with (the sampler's, or an iterable dataset's),
            given rank 0's state at the start of each epoch.
        skip_batches: batches of the first iteration to skip.
        non_blocking: asynchronous host-to-device copies.

    The private arguments are what :func:`prepare_data_loader` settled; ``_state`` and ``_gradient_state`` are the
    preparing Accelerator's (None: the process's).
    """

    def __init__(
        self,
        dataset,
        device=None,
        rng_types=None,
        synchronized_generator=None,
        skip_batches: int = 0,
        _non_blocking: bool = False,
        _sharder=None,
        _drop_last: bool = False,
        _local_batch_size: int | None = None,
        _num_processes: int = 1,
        _state=None,
        _gradient_state=None,
        **kwargs,
    ):
        self._local_batch_size = _local_batch_size
        self._num_processes = _num_processes
        super().__init__(dataset, **kwargs)
        self._drop_last = _drop_last
        self._init_state(_state, _gradient_state)
        self.device = torch.device(device) if device is not None else None
        self._place = self.device is not None and self.device.type != "cpu"
        self.rng_types = list(rng_types or [])
        self.synchronized_generator = synchronized_generator
        self._non_blocking = _non_blocking
        self._sharder = _sharder
        self._samples = 0  # without a sharder: samples of the running iteration, counted from its batches
        if skip_batches:
            self.skip_batches_next_epoch(skip_batches)

    @property
    def final_round(self) -> FinalRound | None:
        return getattr(self._sharder, "final_round", None)

    def _initial_remainder(self) -> int:
        if self._drop_last:
            return -1
        try:
            return _dataset_length(self.dataset) % _accelerate_total_batch_size(self)
        except Exception:  # noqa: BLE001 - Accelerate's rule: any failure (no length, no batch size) means unknown
            return -1

    def _process_count(self) -> int:
        return self._num_processes

    @property
    def _counts_samples(self) -> bool:
        return self._sharder is not None or self._num_processes == 1

    def _samples_consumed(self) -> int:
        return self._samples if self._sharder is None else self._sharder.samples_after(self._yielded)

    def _per_round(self) -> int | None:
        return self.total_batch_size

    def _samples_in(self, batch) -> int:
        """Samples of the order in one batch of a loader without a sharder (one element each without batching)."""
        return 1 if self.batch_size is None else rows_in(batch)

    @property
    def split_batches(self) -> bool:
        """True when each batch of the original loader is the global batch, cut between the processes."""
        return bool(getattr(self._sharder, "split_batches", False))

    @property
    def even_batches(self) -> bool | None:
        """Whether the last round is completed with samples from the start of the epoch (None when the loader is not
        sharded)."""
        return getattr(self._sharder, "even_batches", None)

    @even_batches.setter
    def even_batches(self, value: bool) -> None:
        if self._sharder is None:
            raise ConfigError(
                "even_batches: this dataloader is not sharded between processes, so it has no last round to complete."
            )
        self._sharder.even_batches = bool(value)

    @property
    def total_batch_size(self) -> int | None:
        """Samples per step across all processes (None when the batch sampler has no fixed size).

        ``batch_size`` itself is ``DataLoader``'s, as in Accelerate: None when batches come from a batch sampler.
        """
        size = self._local_batch_size if self._local_batch_size is not None else self.batch_size
        return None if size is None else size * self._num_processes

    @property
    def total_dataset_length(self) -> int:
        """Length of the underlying dataset."""
        dataset = self.dataset.dataset if isinstance(self.dataset, IterableDatasetShard) else self.dataset
        return len(dataset)

    def _sync_rngs(self) -> None:
        """Give every rank rank 0's generators: those of ``rng_types``, and always the shuffling generator
        (so that the ranks shuffle alike even when ``rng_types`` leaves it out)."""
        others = [t for t in self.rng_types if str(t) != "generator"]
        if others:
            broadcast_rng_states(self._process, others)
        if self.synchronized_generator is not None:
            broadcast_rng_state(self._process, "generator", generator=self.synchronized_generator)

    def _start(self) -> Iterator:
        """Start an epoch: synchronise, set the epoch, then create the iterator, skip to a resumed position and fetch
        the first batch under :meth:`_epoch_randomness` (an epoch's start draws there). An epoch resumed with zero
        batches left draws nothing. Returns the iterator."""
        resume = self._take_resume()
        if resume is None:
            return iter(())
        batches, samples = resume
        self._sync_rngs()
        self._propagate_epoch()
        with self._epoch_randomness():
            if self._sharder is not None:  # skips index lists: nothing is loaded
                self._sharder.skip_next_iteration(batches, samples or 0)
                iterator = super().__iter__()
            else:
                iterator = self._skip_loaded(super().__iter__(), batches, samples)
            head = list(itertools.islice(iterator, 1))
        return itertools.chain(head, iterator)

    def _skip_loaded(self, iterator: Iterator, batches: int, samples: int | None) -> Iterator:
        """Without a sharder, skip to the resumed position by loading the batches before it."""
        self._samples = 0
        if samples:

            def started(count: int) -> None:
                self._samples = count

            return skip_samples(iterator, samples, self._samples_in, lambda batch: None, started, is_main=True)
        for _ in range(batches):
            batch = next(iterator, _END)
            if batch is _END:
                break
            self._samples += self._samples_in(batch)
        return iterator

    def __iter__(self):
        if preemption.save_due:
            preemption.batch_requested(self)
        iterator = self._start()
        self.begin()
        try:
            upcoming = next(iterator, _END)
            self.end_of_dataloader = upcoming is _END
            while upcoming is not _END:
                current = upcoming
                if self._place:
                    current = send_to_device(current, self.device, non_blocking=self._non_blocking)
                upcoming = next(iterator, _END)
                self.end_of_dataloader = upcoming is _END
                self._yielded += 1
                if self._sharder is None:
                    self._samples += self._samples_in(current)
                yield current
                if preemption.save_due:  # also after the last batch: the position then says "epoch done"
                    preemption.batch_requested(self)
            self._finish_epoch()
        finally:
            self.end()
