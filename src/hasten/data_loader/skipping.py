"""``skip_first_batches``: the loader it returns for a prepared loader (a view of that loader, of its class) and for
a plain ``DataLoader`` (rebuilt to skip, :class:`SkipDataLoader`).

The view of a prepared loader is a real subclass of the loader's class (``isinstance(view, DataLoader)`` and
``isinstance(view, DataLoaderShard)`` or ``DataLoaderDispatcher`` hold, as for Accelerate's copy) that shares the
loader's attributes: its epoch, its position in the epoch and what ``save_state`` records are the prepared
loader's. A checkpoint taken while the view is iterated therefore holds the view's position, and once the view's
epoch ends the prepared loader is in the next one.
"""

from __future__ import annotations

from torch.utils.data import DataLoader, IterableDataset

from ..errors import ConfigError
from .dispatcher import DataLoaderDispatcher
from .loaders import DataLoaderShard, DataLoaderStateMixin, _ItselfOnInstances, _loader_kwargs
from .sequence_sharding import SequenceShardingLoader
from .sharding import SkipBatchSampler


class _SkipView:
    """What the views of prepared loaders add to the loader's class: each iteration starts at batch
    ``_skip_batches`` of the current epoch (absolute: a position restored by ``load_state`` is replaced, not added
    to). The attributes live in the viewed loader's ``__dict__``; the number of batches, in a slot of the view."""

    __slots__ = ("_skip_batches",)

    def __iter__(self):
        self.skip_batches_next_epoch(self._skip_batches)
        return super().__iter__()

    def __len__(self) -> int:
        """The loader's batches less the skipped ones; over an iterable dataset, the loader's length unchanged
        (as Accelerate's: the length of a stream cannot say how many batches remain)."""
        length = super().__len__()
        if isinstance(self.dataset, IterableDataset):
            return length
        return max(length - self._skip_batches, 0)


class SkippedDataLoaderShard(_SkipView, DataLoaderShard):
    """The :class:`DataLoaderShard` that :func:`skip_first_batches` returns for one: the same loader, whose
    iterations start at a batch of the epoch."""

    __slots__ = ()


class SkippedDataLoaderDispatcher(_SkipView, DataLoaderDispatcher):
    """The :class:`DataLoaderDispatcher` that :func:`skip_first_batches` returns for one: the same loader, whose
    iterations start at a global batch of the epoch."""

    __slots__ = ()


def _view(loader: DataLoaderStateMixin, num_batches: int) -> DataLoader:
    cls = SkippedDataLoaderDispatcher if isinstance(loader, DataLoaderDispatcher) else SkippedDataLoaderShard
    view = object.__new__(cls)
    object.__setattr__(view, "__dict__", loader.__dict__)  # one loader, two faces: state and settings are shared
    object.__setattr__(view, "_skip_batches", num_batches)
    return view


class SkipDataLoader(DataLoader):
    """A ``DataLoader`` that skips its first ``skip_batches`` batches on each iteration."""

    base_dataloader = _ItselfOnInstances()

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


def skip_first_batches(dataloader, num_batches: int = 0):
    """A loader whose iterations start at batch ``num_batches`` of the epoch (each iteration: use it for the epoch
    being resumed, then the loader itself).

    For a prepared loader it is a view of that loader, of its class (:class:`SkippedDataLoaderShard`,
    :class:`SkippedDataLoaderDispatcher`): it shares the loader's epoch and position, so ``save_state`` while the
    view is iterated records where the view is, and after the view's epoch the loader is in the next epoch. The
    position is absolute: after ``load_state`` restored a mid-epoch position, ``skip_first_batches(loader, n)``
    starts at batch ``n``, it does not skip ``n`` more. A dispatched loader skips ``n`` of the batches it hands
    out (global steps). ``len()`` is the loader's less ``n``, except over an iterable dataset (unchanged, as in
    Accelerate). A plain ``DataLoader`` is rebuilt to skip its first batches.
    """
    if num_batches < 0:
        raise ConfigError(f"skip_first_batches(num_batches={num_batches}): give a number >= 0.")
    if isinstance(dataloader, SequenceShardingLoader):  # sequence parallelism's split of a prepared loader
        return dataloader.over(skip_first_batches(dataloader.loader, num_batches))
    if isinstance(dataloader, (DataLoaderShard, DataLoaderDispatcher)):
        return _view(dataloader, num_batches)
    if (
        isinstance(dataloader, DataLoader)
        and dataloader.batch_sampler is not None
        and not isinstance(dataloader.dataset, IterableDataset)
    ):
        return DataLoader(
            dataloader.dataset,
            batch_sampler=SkipBatchSampler(dataloader.batch_sampler, num_batches),
            **_loader_kwargs(dataloader),
        )
    if isinstance(dataloader, DataLoader):
        return SkipDataLoader(
            dataloader.dataset,
            skip_batches=num_batches,
            batch_size=dataloader.batch_size,
            drop_last=dataloader.drop_last,
            **_loader_kwargs(dataloader),
        )
    raise TypeError(f"skip_first_batches needs a DataLoader, got {type(dataloader).__name__}.")
