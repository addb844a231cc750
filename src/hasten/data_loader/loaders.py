"""Prepared dataloaders: sharded (:class:`DataLoaderShard`; the one dispatched from rank 0 is in ``dispatcher.py``).

Both look one batch ahead so that ``end_of_dataloader`` is known while the last batch is processed
(gradient accumulation forces a sync there; ``gather_for_metrics`` drops padded samples there), both
know their position (epoch, batches consumed) so ``save_state``/``load_state`` can resume mid-epoch,
and both place batches on the process's device.
"""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from ..runtime import preemption
from ..errors import ConfigError
from ..runtime.tree import send_to_device
from ..runtime.rng import synchronize_rng_state, synchronize_rng_states
from ..state import GradientState, warn_once
from .sharding import BatchSamplerShard, FinalRound, IterableDatasetShard, SeedableRandomSampler, SkipBatchSampler, get_sampler

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


class DataLoaderStateMixin:
    """Tracks the epoch, the position inside it and the end of the data, and registers with :class:`GradientState`.

    The position is kept in samples of the epoch's global order (see :mod:`.position`), so a state saved
    on N processes resumes on M. A state saved inside the loop after the epoch's last batch resumes with
    that epoch's remaining zero batches: the next iteration yields nothing and ends the epoch, as the
    uninterrupted run's loop would have seen. A state saved after the iteration ended resumes with the
    next epoch.
    """

    def _init_state(self) -> None:
        self.gradient_state = GradientState()
        self.end_of_dataloader = False
        self.iteration = 0
        self._yielded = 0  # batches handed out by the running iteration, after its skip
        self._skipped = 0  # this process's batches that the running iteration's skip stood for
        self._active = False
        self._resume: dict[str, Any] | None = None  # where the next iteration starts: {"batches"} or {"samples"}
        self._epoch_start_order: torch.Tensor | None = None  # the order generator's state when this epoch began

    @property
    def remainder(self) -> int:
        """Real samples in the last global batch (-1 when unknown)."""
        final = self.final_round
        return -1 if final is None else final.real

    @property
    def final_round(self) -> FinalRound | None:
        """Layout of the last round of the current epoch, once it is known."""
        return None

    def begin(self) -> None:
        """Mark the start of an iteration and register as the active dataloader."""
        self.end_of_dataloader = False
        self.gradient_state._add_dataloader(self)

    def end(self) -> None:
        """Unregister at the end of an iteration."""
        self.gradient_state._remove_dataloader(self)

    def set_epoch(self, epoch: int) -> None:
        """Start the next iteration at epoch ``epoch``; tells the batch sampler, sampler and dataset that have ``set_epoch``.

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

    def _order_generator(self) -> torch.Generator | None:
        """The generator the sampler draws each epoch's order from, when the order is not seed + epoch (a
        ``RandomSampler`` given the user's generator, a custom sampler with a ``generator``): its state at the
        epoch's start goes into the loader's state, so a resumed epoch is drawn in the same order."""
        sampler = get_sampler(self)
        generator = getattr(sampler, "generator", None)
        if isinstance(sampler, SeedableRandomSampler) or not isinstance(generator, torch.Generator):
            return None
        return generator

    def _note_epoch_start(self) -> None:
        """Called as an iteration starts, before anything draws from the order generator."""
        generator = self._order_generator()
        self._epoch_start_order = generator.get_state() if generator is not None else None

    def state_dict(self) -> dict[str, Any]:
        """Position of this loader (JSON-compatible).

        ``epoch``; ``samples``: samples of the epoch's global order consumed by every process together
        (absent when the loader is sharded by the user's own sampler); ``batches_yielded``: this process's
        batches of the epoch; ``end_of_epoch``: the epoch's last batch was handed out; ``num_processes``;
        and ``seed``, the shuffling seed, when seeded.
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
        generator = self._order_generator()
        if generator is not None:  # mid-epoch: replay the epoch's order; otherwise the next epoch's draw
            order = self._epoch_start_order if self._active and not end else generator.get_state()
            state["order_generator"] = base64.b64encode(order.numpy().tobytes()).decode("ascii")
        sampler = get_sampler(self)
        if isinstance(sampler, SeedableRandomSampler):
            state["seed"] = sampler.initial_seed
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at the position saved by :meth:`state_dict`, also on another number of processes: the next
        iteration continues that epoch (with zero batches when the save followed the epoch's last batch)."""
        self._restore_epoch_and_seed(state, int(state["epoch"]))
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
                f"is resumed on {world}; it is sharded by its own sampler or dataset, so its position cannot be mapped to "
                "the new number of processes: it restarts that epoch from its first batch (samples already trained on "
                "are seen again).",
            )
            self._resume = None

    def restore_epoch(self, state: Mapping[str, Any]) -> None:
        """Restore the epoch and the shuffling seed saved by :meth:`state_dict`, not the position in the epoch.

        The next iteration runs the saved epoch from its first batch, in the saved order (the next epoch when
        the save followed the epoch's last batch), so a loop that skips the batches it already trained on
        (``resume_step = step % len(loader)``, then ``skip_first_batches`` or ``if step < resume_step: continue``)
        sees the same data as the interrupted run. This is what ``load_state`` does unless
        ``DataLoaderConfiguration(use_stateful_dataloader=True)``.
        """
        self._restore_epoch_and_seed(state, int(state["epoch"]) + (1 if state.get("end_of_epoch") else 0))
        self._resume = None

    def _restore_epoch_and_seed(self, state: Mapping[str, Any], epoch: int) -> None:
        self.iteration = epoch
        sampler = get_sampler(self)
        if "seed" in state and isinstance(sampler, SeedableRandomSampler):
            sampler.initial_seed = int(state["seed"])
        generator = self._order_generator()
        if generator is not None and "order_generator" in state:
            saved = bytearray(base64.b64decode(state["order_generator"]))
            generator.set_state(torch.frombuffer(saved, dtype=torch.uint8))

    def skip_batches_next_epoch(self, num_batches: int) -> None:
        """Start the next iteration at batch ``num_batches`` of the current epoch (absolute, not cumulative)."""
        self._resume = {"batches": int(num_batches)}

    def _take_resume(self) -> tuple[int, int | None] | None:
        """Begin an iteration: (batches to skip, samples to skip or None), or None when the epoch has zero batches
        left (the iteration ends without drawing anything); resets the iteration's counters."""
        resume, self._resume = self._resume, None
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

    def _finish_epoch(self) -> None:
        self.iteration += 1
        self._yielded = self._skipped = 0
        self._active = False


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


class DataLoaderShard(DataLoaderStateMixin, DataLoader):
    """A ``DataLoader`` whose batches are this process's share, placed on ``device``.

    Built by :func:`prepare_data_loader`; the arguments are those of ``DataLoader`` plus:

    Args:
        device: where to put each batch (None leaves them where they are).
        rng_types: generators synchronised from rank 0 at the start of each epoch.
        synchronized_generator: the sampler's generator, synchronised when ``"generator"`` is in ``rng_types``.
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
        _loader_seed: int | None = None,
        _local_batch_size: int | None = None,
        _num_processes: int = 1,
        **kwargs,
    ):
        self._local_batch_size = _local_batch_size
        self._num_processes = _num_processes
        if _loader_seed is not None and kwargs.get("generator") is None:
            kwargs["generator"] = torch.Generator()
        super().__init__(dataset, **kwargs)
        # With its own generator, starting an epoch does not draw from the global RNG (the worker base
        # seed comes from this generator, reseeded per epoch), so a resumed run keeps the same stream.
        self._loader_seed = _loader_seed
        self._init_state()
        self.device = torch.device(device) if device is not None else None
        self._place = self.device is not None and self.device.type != "cpu"
        self.rng_types = list(rng_types or [])
        self.synchronized_generator = synchronized_generator
        self._non_blocking = _non_blocking
        self._sharder = _sharder
        if skip_batches:
            self.skip_batches_next_epoch(skip_batches)

    @property
    def final_round(self) -> FinalRound | None:
        return getattr(self._sharder, "final_round", None)

    def _process_count(self) -> int:
        return self._num_processes

    @property
    def _counts_samples(self) -> bool:
        return self._sharder is not None

    def _samples_consumed(self) -> int:
        return self._sharder.samples_after(self._yielded)

    def _per_round(self) -> int | None:
        return self.total_batch_size

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
    def batch_size(self) -> int | None:
        """Samples per batch on this process (None when the batch sampler has no fixed size)."""
        own = self.__dict__.get("_batch_size")
        return own if own is not None else self.__dict__.get("_local_batch_size")

    @batch_size.setter
    def batch_size(self, value) -> None:
        self.__dict__["_batch_size"] = value

    @property
    def total_batch_size(self) -> int | None:
        """Samples per step across all processes (None when the batch sampler has no fixed size)."""
        return None if self.batch_size is None else self.batch_size * self._num_processes

    @property
    def total_dataset_length(self) -> int:
        """Length of the underlying dataset."""
        dataset = self.dataset.dataset if isinstance(self.dataset, IterableDatasetShard) else self.dataset
        return len(dataset)

    def _sync_rngs(self) -> None:
        if not self.rng_types:
            return
        others = [t for t in self.rng_types if str(t) != "generator"]
        if others:
            synchronize_rng_states(others)
        if "generator" in [str(t) for t in self.rng_types] and self.synchronized_generator is not None:
            synchronize_rng_state("generator", generator=self.synchronized_generator)

    def _start(self):
        self._sync_rngs()
        self._propagate_epoch()
        if self._loader_seed is not None:
            self.generator.manual_seed(self._loader_seed + self.iteration)
        resume = self._take_resume()
        if resume is None:
            return iter(())
        batches, samples = resume
        self._note_epoch_start()
        if self._sharder is not None:
            self._sharder.skip_next_iteration(batches, samples or 0)
            return super().__iter__()
        iterator = super().__iter__()
        for _ in range(batches):
            if next(iterator, _END) is _END:
                break
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
                yield current
                if preemption.save_due:  # also after the last batch: the position then says "epoch done"
                    preemption.batch_requested(self)
            self._finish_epoch()
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
