"""``prepare_data_loader``: turn a user's ``DataLoader`` into this process's sharded (or dispatched) loader.

Custom samplers and batch samplers are kept and sharded around (:class:`~.sharding.BatchSamplerShard`);
only a plain ``RandomSampler`` is swapped for a :class:`~.sharding.SeedableRandomSampler` seeded the
same on every process.
"""

from __future__ import annotations

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler
from torch.utils.data.distributed import DistributedSampler

from ..errors import ConfigError
from ..runtime.operations import broadcast_object_list
from ..state import PartialState, warn_once
from .dispatcher import DataLoaderDispatcher
from .loaders import DataLoaderShard, _loader_kwargs
from .sharding import BatchSamplerShard, IterableDatasetShard, SeedableRandomSampler, get_sampler


def _user_sharded(dataloader: DataLoader) -> bool:
    if isinstance(get_sampler(dataloader), DistributedSampler):
        return True
    dataset = dataloader.dataset
    return isinstance(dataset, IterableDataset) and bool(getattr(dataset, "hasten_sharded", False) or getattr(dataset, "_distributed", None))


def _shared_seed(data_seed: int | None, generator) -> int:
    """``data_seed``, or a seed drawn on the main process and shared with every process (one small broadcast)."""
    if data_seed is not None:
        return int(data_seed)
    seed = [int(torch.randint(0, 2**62, (1,), generator=generator).item())]
    return broadcast_object_list(seed)[0]


def _seeded_batch_sampler(dataloader: DataLoader, data_seed: int, use_seedable_sampler: bool = False):
    """The loader's batch sampler, with a plain ``RandomSampler`` replaced by a seeded one shared by all ranks.

    Custom samplers (subclasses included) and custom batch samplers are kept, as in Accelerate; a custom
    sampler with an unset ``generator`` gets one seeded with the shared seed, so every rank draws the
    same order. A ``RandomSampler`` given the user's own generator keeps it (without
    ``use_seedable_sampler``), as in Accelerate: a script that re-seeds that generator after ``prepare``
    steers the order, which rank 0 shares with every rank at each epoch start.
    """
    batch_sampler = _batch_sampler_of(dataloader)
    sampler = get_sampler(dataloader)
    if isinstance(sampler, SeedableRandomSampler):
        return batch_sampler, None
    if type(sampler) is not RandomSampler:
        if hasattr(sampler, "generator") and sampler.generator is None:
            sampler.generator = torch.Generator().manual_seed(data_seed)
            return batch_sampler, None
        return batch_sampler, getattr(sampler, "generator", None)
    if sampler.generator is not None and not use_seedable_sampler:
        return batch_sampler, sampler.generator
    if sampler.generator is not None:  # the user seeded shuffling with their own generator: derive from it
        data_seed = int(torch.randint(0, 2**62, (1,), generator=sampler.generator).item()) ^ data_seed
    seeded = SeedableRandomSampler(sampler.data_source, replacement=sampler.replacement, num_samples=sampler._num_samples, data_seed=data_seed)
    if type(batch_sampler) is BatchSampler:
        return BatchSampler(seeded, batch_sampler.batch_size, batch_sampler.drop_last), None
    try:
        batch_sampler.sampler = seeded
    except AttributeError:
        warn_once("custom-batch-sampler", f"Could not give {type(batch_sampler).__name__} a shared seed; its shuffling is synchronised per epoch instead.")
        return batch_sampler, sampler.generator
    return batch_sampler, None


def prepare_data_loader(
    dataloader: DataLoader,
    device=None,
    num_processes: int | None = None,
    process_index: int | None = None,
    split_batches: bool = False,
    put_on_device: bool = False,
    rng_types=None,
    dispatch_batches: bool | None = None,
    even_batches: bool = True,
    slice_fn_for_dispatch=None,
    use_seedable_sampler: bool = False,
    data_seed: int | None = None,
    non_blocking: bool = False,
    use_stateful_dataloader: bool = False,
    torch_device_mesh=None,
) -> DataLoader:
    """Return a loader that gives this process its share of ``dataloader``'s batches.

    See :class:`~hasten.DataLoaderConfiguration` for ``split_batches``, ``dispatch_batches``,
    ``even_batches``, ``data_seed`` and ``non_blocking``. Shuffling is always seeded the same on every
    process (a plain ``RandomSampler`` becomes a :class:`SeedableRandomSampler`), so
    ``use_seedable_sampler`` is implied. A loader that is already sharded (a ``DistributedSampler``,
    or an ``IterableDataset`` marked ``hasten_sharded = True`` / split by node) is not sharded again.

    Args:
        dataloader: the loader to prepare.
        device: where batches go when ``put_on_device``.
        num_processes, process_index: default to the current process state.
        rng_types: generators synchronised at each epoch start (``"torch"``, ``"cuda"``, ``"generator"``).
        slice_fn_for_dispatch: with ``dispatch_batches``, how a global batch is cut for each process
            (see :class:`DataLoaderDispatcher`).
        use_stateful_dataloader, torch_device_mesh: accepted for compatibility: every prepared loader records
            its position (whether ``load_state`` restores it is the Accelerator's ``use_stateful_dataloader``),
            and hasten's loaders shard by data-parallel rank only.
    """
    if not isinstance(dataloader, DataLoader):
        raise TypeError(f"prepare_data_loader needs a torch.utils.data.DataLoader, got {type(dataloader).__name__}.")
    state = PartialState()
    world = num_processes if num_processes is not None else state.num_processes
    rank = process_index if process_index is not None else state.process_index
    if split_batches:
        _check_split_batches(dataloader, world)
    device = device if put_on_device else None
    dataset = dataloader.dataset
    iterable = isinstance(dataset, IterableDataset)
    kwargs = _loader_kwargs(dataloader)
    if _user_sharded(dataloader):
        return _keep_user_sharding(dataloader, world, device, non_blocking, kwargs)
    if dispatch_batches is None:
        dispatch_batches = iterable and world > 1
    if dispatch_batches and world > 1:
        return _dispatcher(dataloader, split_batches, even_batches, device, non_blocking, slice_fn_for_dispatch, data_seed, kwargs)
    if iterable:  # batch_size=None: the dataset yields whole batches, dealt to the processes in turn
        shard = IterableDatasetShard(dataset, batch_size=dataloader.batch_size, drop_last=dataloader.drop_last, num_processes=world, process_index=rank, split_batches=split_batches, even_batches=even_batches)
        local = _per_process(dataloader.batch_size, world, split_batches)
        return DataLoaderShard(shard, device=device, rng_types=rng_types, batch_size=local, drop_last=dataloader.drop_last, _non_blocking=non_blocking, _sharder=shard, _num_processes=world, **kwargs)
    if _batch_sampler_of(dataloader) is None:
        raise ConfigError(
            "prepare() supports map-style DataLoaders that batch (batch_size set, a batch_sampler, or a BatchSampler "
            "given as sampler with batch_size=None); this one has batch_size=None and a plain sampler."
        )
    seed = _shared_seed(data_seed, None)
    batch_sampler, generator = _seeded_batch_sampler(dataloader, seed, use_seedable_sampler)
    sharder = BatchSamplerShard(batch_sampler, world, rank, split_batches, even_batches)  # also alone: it resumes mid-epoch
    # a BatchSampler given as `sampler` (batch_size=None) stays in that place, as Accelerate keeps it
    placement = {"batch_sampler": sharder} if dataloader.batch_sampler is not None else {"sampler": sharder, "batch_size": None}
    return DataLoaderShard(
        dataset,
        device=device,
        rng_types=rng_types,
        synchronized_generator=generator,
        **placement,
        _non_blocking=non_blocking,
        _sharder=sharder,
        _loader_seed=seed if kwargs.get("generator") is None else None,
        _local_batch_size=_per_process(_batch_size_of(dataloader), world, split_batches),
        _num_processes=world,
        **kwargs,
    )


def _check_split_batches(dataloader: DataLoader, world: int) -> None:
    """Accelerate's check: with ``split_batches`` the loader's batch size must be known and, above 1, divisible."""
    size = _batch_size_of(dataloader)
    if size is None:
        raise ConfigError(
            f"split_batches=True needs to know the batch size to cut it: this DataLoader has batch_size=None and its "
            f"batch sampler ({type(dataloader.batch_sampler).__name__}) has no `batch_size` attribute. Give the batch "
            "sampler a batch_size, or use split_batches=False."
        )
    if size > 1 and size % world != 0:
        raise ConfigError(
            f"split_batches=True cuts each batch of {size} into {world} pieces, so the batch size must be a multiple of "
            f"the number of processes ({world}). Use a batch size of {world * max(size // world, 1)} or "
            f"{world * (size // world + 1)}, or split_batches=False (each process then loads whole batches of {size})."
        )


def _batch_sampler_of(dataloader: DataLoader):
    """The loader's batch sampler, or the ``BatchSampler`` it was given as ``sampler`` (with ``batch_size=None``)."""
    if dataloader.batch_sampler is not None:
        return dataloader.batch_sampler
    return dataloader.sampler if isinstance(dataloader.sampler, BatchSampler) else None


def _batch_size_of(dataloader: DataLoader) -> int | None:
    return dataloader.batch_size if dataloader.batch_size is not None else getattr(_batch_sampler_of(dataloader), "batch_size", None)


def _per_process(size: int | None, world: int, split_batches: bool) -> int | None:
    if size is None:
        return None
    return size // world if split_batches else size


def _dispatcher(dataloader, split_batches, even_batches, device, non_blocking, slice_fn, data_seed, kwargs) -> DataLoaderDispatcher:
    size = dataloader.batch_size or getattr(dataloader.batch_sampler, "batch_size", None)
    if size is None:
        raise ConfigError("dispatch_batches=True needs a DataLoader with a batch_size (or a batch sampler that has one).")
    if isinstance(dataloader.dataset, IterableDataset):
        kwargs.update(batch_size=dataloader.batch_size, drop_last=dataloader.drop_last)
    else:
        kwargs["batch_sampler"] = _seeded_batch_sampler(dataloader, _shared_seed(data_seed, None))[0]
    drop_last = getattr(dataloader.batch_sampler, "drop_last", dataloader.drop_last)
    return DataLoaderDispatcher(
        dataloader.dataset, split_batches=split_batches, even_batches=even_batches, device=device, _non_blocking=non_blocking, slice_fn=slice_fn, _batch_size=size, _drop_last=drop_last, **kwargs
    )


def _keep_user_sharding(dataloader: DataLoader, world: int, device, non_blocking: bool, kwargs: dict) -> DataLoader:
    """A loader already sharded between processes (a ``DistributedSampler``, a self-sharding dataset), kept as is."""
    warn_once("user-sharded", "This dataloader is already sharded between processes (DistributedSampler or a self-sharding dataset); hasten keeps it as is and does not shard it again.")
    sizes = {"_local_batch_size": _batch_size_of(dataloader), "_num_processes": world}
    if isinstance(dataloader.dataset, IterableDataset):
        return DataLoaderShard(dataloader.dataset, device=device, batch_size=dataloader.batch_size, drop_last=dataloader.drop_last, _non_blocking=non_blocking, **sizes, **kwargs)
    return DataLoaderShard(dataloader.dataset, device=device, batch_sampler=dataloader.batch_sampler, _non_blocking=non_blocking, **sizes, **kwargs)
