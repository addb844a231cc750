"""Prepared dataloaders: sharded (:class:`DataLoaderShard`; the one dispatched from rank 0 is in ``dispatcher.py``).

Both look one batch ahead so that ``end_of_dataloader`` is known while the last batch is processed
(gradient accumulation forces a sync there; ``gather_for_metrics`` drops padded samples there), both
know their position (epoch, batches consumed) so ``save_state``/``load_state`` can resume mid-epoch,
and both place batches on the process's device.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset

from ..runtime import preemption
from ..errors import ConfigError
from ..runtime.tree import send_to_device
from ..runtime.rng import synchronize_rng_state, synchronize_rng_states
from ..state import GradientState
from .epoch_rng import EpochStart, epoch_randomness
from .sharding import BatchSamplerShard, FinalRound, IterableDatasetShard, SeedableRandomSampler, SkipBatchSampler, get_sampler

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


class DataLoaderStateMixin:
    """Tracks the epoch, the position inside it and the end of the data, and registers with :class:`GradientState`."""

    def _init_state(self) -> None:
        self.gradient_state = GradientState()
        self.end_of_dataloader = False
        self.iteration = 0
        self._yielded = 0
        self._resume_at = 0
        self._epoch_start: EpochStart | None = None
        self._replay: EpochStart | None = None
        self.remainder = -1

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
        """Start the next iteration at epoch ``epoch``; tells the batch sampler, sampler and dataset that have ``set_epoch``."""
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

    def state_dict(self) -> dict[str, Any]:
        """Position of this loader: ``{"epoch", "batches_yielded"}``, the seedable sampler's ``"seed"``, and ``"rng"``:
        inside an epoch the generators' states it started from, between epochs the loader's own generators'
        current states (``epoch_rng.py``)."""
        epoch, yielded = self.iteration, self._yielded
        if yielded and yielded >= _safe_len(self):
            epoch, yielded = epoch + 1, 0
        state = {"epoch": epoch, "batches_yielded": yielded}
        sampler = get_sampler(self)
        if isinstance(sampler, SeedableRandomSampler):
            state["seed"] = sampler.initial_seed
        if yielded and self._epoch_start is not None:  # inside an epoch: how it started, to replay its order
            state["rng"] = self._epoch_start.to_json()
        else:  # between epochs: where the loader's own generators stand, for the epochs that follow
            state["rng"] = EpochStart.capture(self, with_global=False).to_json()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at the position saved by :meth:`state_dict`: the next iteration continues that epoch."""
        self.restore_epoch(state)
        self._resume_at = int(state.get("batches_yielded", 0))

    def restore_epoch(self, state: Mapping[str, Any]) -> None:
        """Restore the epoch, the seed and how the epoch started, saved by :meth:`state_dict`, not the position in it.

        The next iteration runs the saved epoch from its first batch, in the saved order, so a loop that
        skips the batches it already trained on (``if step < resume_step: continue``, or
        :func:`skip_first_batches`) sees the same data as the interrupted run. This is what ``load_state``
        does unless ``DataLoaderConfiguration(use_stateful_dataloader=True)``.
        """
        self.iteration = int(state["epoch"])
        self._resume_at = 0
        self._replay = EpochStart.from_json(state["rng"]) if state.get("rng") else None
        sampler = get_sampler(self)
        if "seed" in state and isinstance(sampler, SeedableRandomSampler):
            sampler.initial_seed = int(state["seed"])

    def skip_batches_next_epoch(self, num_batches: int) -> None:
        """Start the next iteration at batch ``num_batches`` of the current epoch (absolute, not cumulative)."""
        self._resume_at = int(num_batches)


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


def _safe_len(loader) -> float:
    try:
        return len(loader)
    except TypeError:
        return math.inf


class DataLoaderShard(DataLoaderStateMixin, DataLoader):
    """A ``DataLoader`` whose batches are this process's share, placed on ``device``.

    Built by :func:`prepare_data_loader`; the arguments are those of ``DataLoader`` plus:

    Args:
        device: where to put each batch (None leaves them where they are).
        rng_types: generators synchronised from rank 0 at the start of each epoch.
        synchronized_generator: the generator every rank shuffles with (the sampler's, or an iterable dataset's),
            given rank 0's state at the start of each epoch.
        non_blocking: asynchronous host-to-device copies.
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
        **kwargs,
    ):
        self._local_batch_size = _local_batch_size
        self._num_processes = _num_processes
        super().__init__(dataset, **kwargs)
        self._drop_last = _drop_last
        self._init_state()
        self.device = torch.device(device) if device is not None else None
        self._place = self.device is not None and self.device.type != "cpu"
        self.rng_types = list(rng_types or [])
        self.synchronized_generator = synchronized_generator
        self._non_blocking = _non_blocking
        self._sharder = _sharder
        self._resume_at = skip_batches

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

    @property
    def split_batches(self) -> bool:
        """True when each batch of the original loader is the global batch, cut between the processes."""
        return bool(getattr(self._sharder, "split_batches", False))

    @property
    def even_batches(self) -> bool | None:
        """Whether the last round is completed with samples from the start of the epoch (None when the loader is not sharded)."""
        return getattr(self._sharder, "even_batches", None)

    @even_batches.setter
    def even_batches(self, value: bool) -> None:
        if self._sharder is None:
            raise ConfigError("even_batches: this dataloader is not sharded between processes, so it has no last round to complete.")
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
            synchronize_rng_states(others)
        if self.synchronized_generator is not None:
            synchronize_rng_state("generator", generator=self.synchronized_generator)

    def _start(self):
        """Start an epoch: synchronise, set the epoch, create the iterator and fetch the first batch (the draws of an
        epoch's start happen there; a resumed epoch replays them, see ``epoch_rng.py``). Returns the iterator."""
        self._sync_rngs()
        self._propagate_epoch()
        skip, self._resume_at = self._resume_at, 0
        sharded = isinstance(self.batch_sampler, BatchSamplerShard)
        with epoch_randomness(self):
            if sharded:
                self.batch_sampler.skip_next_iteration(skip)
            iterator = super().__iter__()
            for _ in range(0 if sharded else skip):
                if next(iterator, None) is None:
                    break
            head = list(itertools.islice(iterator, 1))
        self._yielded = skip
        return itertools.chain(head, iterator)

    def __iter__(self):
        if preemption.save_due:
            preemption.batch_requested(self)
        iterator = self._start()
        self.begin()
        try:
            try:
                current = next(iterator)
            except StopIteration:
                self.end_of_dataloader = True
                return
            while True:
                if self._place:
                    current = send_to_device(current, self.device, non_blocking=self._non_blocking)
                try:
                    upcoming = next(iterator)
                except StopIteration:
                    self.end_of_dataloader = True
                    self._yielded += 1
                    yield current
                    break
                self._yielded += 1
                yield current
                if preemption.save_due:
                    preemption.batch_requested(self)
                current = upcoming
            self.iteration += 1
            self._yielded = 0
        finally:
            self.end()


class SkipDataLoader(DataLoader):
    """A ``DataLoader`` that skips its first ``skip_batches`` batches on each iteration."""

    def __init__(self, dataset, skip_batches: int = 0, **kwargs):
        super().__init__(dataset, **kwargs)
        self.skip_batches = skip_batches

    def __iter__(self):
        iterator = super().__iter__()
        for _ in range(self.skip_batches):
            if next(iterator, None) is None:
                return
        yield from iterator

    def __len__(self) -> int:
        return max(super().__len__() - self.skip_batches, 0)


class _SkipView:
    """What :func:`skip_first_batches` returns for a prepared loader: iterating it resumes the loader at a batch."""

    def __init__(self, loader, num_batches: int):
        self._loader = loader
        self._num_batches = num_batches

    def __iter__(self):
        self._loader.skip_batches_next_epoch(self._num_batches)
        return iter(self._loader)

    def __len__(self) -> int:
        return max(len(self._loader) - self._num_batches, 0)

    def __getattr__(self, name):
        return getattr(self._loader, name)


def skip_first_batches(dataloader, num_batches: int = 0):
    """A loader whose next iteration starts at batch ``num_batches`` of the current epoch.

    For a prepared loader the position is absolute: after ``load_state`` restored a mid-epoch
    position, ``skip_first_batches(loader, n)`` starts at batch ``n``, it does not skip ``n`` more.
    Later epochs start from the beginning. A plain ``DataLoader`` is rebuilt to skip its first batches.
    """
    if num_batches < 0:
        raise ConfigError(f"skip_first_batches(num_batches={num_batches}): give a number >= 0.")
    if isinstance(dataloader, DataLoaderStateMixin):
        return _SkipView(dataloader, num_batches)
    if isinstance(dataloader, DataLoader) and dataloader.batch_sampler is not None and not isinstance(dataloader.dataset, IterableDataset):
        return DataLoader(dataloader.dataset, batch_sampler=SkipBatchSampler(dataloader.batch_sampler, num_batches), **_loader_kwargs(dataloader))
    if isinstance(dataloader, DataLoader):
        return SkipDataLoader(dataloader.dataset, skip_batches=num_batches, batch_size=dataloader.batch_size, drop_last=dataloader.drop_last, **_loader_kwargs(dataloader))
    raise TypeError(f"skip_first_batches needs a DataLoader, got {type(dataloader).__name__}.")
