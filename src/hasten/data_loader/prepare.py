"""``prepare_data_loader``: turn a user's ``DataLoader`` into this process's sharded (or dispatched) loader.

Random streams are consumed exactly as Accelerate 1.15 consumes them, so a script seeded the same gets the
same numbers (shuffles, dropout, everything drawn after them):

* one process: the user's sampler and batch sampler are kept as they are, so shuffling draws from the
  global torch generator at each epoch as a plain ``DataLoader`` does; nothing is drawn at ``prepare``;
* several processes: a sampler with an unset ``generator`` (``RandomSampler``) gets one, seeded with one draw
  from the global torch generator at ``prepare``; rank 0's state of that generator is given to every rank
  at each epoch start, so every rank shuffles the same way;
* ``use_seedable_sampler``: a ``RandomSampler`` becomes a :class:`~.sharding.SeedableRandomSampler` (order
  from ``data_seed``, else the global seed, plus the epoch); with several processes rank 0's seed is
  shared, so the ranks agree even when their global seeds differ;
* each epoch's iterator draws its workers' base seed as ``DataLoader`` does (on every rank, also when
  the main process dispatches the batches).

Custom samplers and batch samplers are kept and sharded around (:class:`~.sharding.BatchSamplerShard`).
A prepared loader records the generators' states at each epoch start (a copy, not a draw), so that a
resumed epoch replays its order without drawing again (``data_loader/epoch_rng.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler
from torch.utils.data.distributed import DistributedSampler

from ..errors import ConfigError
from ..runtime.operations import broadcast_object_list
from ..state import PROCESS_STATE, GradientState, warn_once
from .dispatcher import DataLoaderDispatcher
from .loaders import DataLoaderShard, _loader_kwargs
from .sharding import (
    BatchSamplerShard,
    IterableDatasetShard,
    PassThroughBatchSampler,
    SeedableRandomSampler,
    get_sampler,
)


def _user_sharded(dataloader: DataLoader) -> bool:
    if isinstance(get_sampler(dataloader), DistributedSampler):
        return True
    dataset = dataloader.dataset
    return isinstance(dataset, IterableDataset) and bool(
        getattr(dataset, "hasten_sharded", False) or getattr(dataset, "_distributed", None)
    )


def _seedable_sampler(sampler: RandomSampler, data_seed: int | None, world: int) -> SeedableRandomSampler:
    """Accelerate's replacement of a ``RandomSampler`` under ``use_seedable_sampler``; the seed is rank 0's."""
    seedable = SeedableRandomSampler(
        sampler.data_source,
        replacement=sampler.replacement,
        num_samples=sampler._num_samples,
        generator=sampler.generator,
        data_seed=data_seed,
    )
    if world > 1 and data_seed is None:  # set_seed(device_specific=True) gives each rank its own global seed
        seedable.initial_seed = broadcast_object_list([seedable.initial_seed])[0]
    return seedable


def _install_sampler(dataloader: DataLoader, sampler) -> None:
    """Put ``sampler`` in the batch sampler of a prepared loader (and of the user's batch sampler inside it)."""
    holder = dataloader.sampler if isinstance(dataloader.sampler, BatchSampler) else dataloader.batch_sampler
    inner = holder.batch_sampler if isinstance(holder, BatchSamplerShard) else holder
    inner.sampler = sampler


def _generator_to_share(sampler) -> torch.Generator | None:
    """The generator every rank shuffles with: the sampler's own, or a new one seeded with one draw from the
    global torch generator (Accelerate's draw), which rank 0 shares at each epoch start."""
    if sampler.generator is None:
        sampler.generator = torch.Generator(device=torch.get_default_device())
        sampler.generator.manual_seed(int(torch.empty((), dtype=torch.int64).random_().item()))
    return sampler.generator


def _dispatches(dataloader: DataLoader, dispatch_batches: bool | None, put_on_device: bool) -> bool:
    """Whether rank 0 reads the batches of ``dataloader`` (checked to be a ``DataLoader``) and dispatches them:
    ``dispatch_batches``, else (None) True for an ``IterableDataset`` placed on the device, as in Accelerate.
    Dispatching places batches, so it needs ``put_on_device``."""
    if not isinstance(dataloader, DataLoader):
        raise TypeError(f"prepare_data_loader needs a torch.utils.data.DataLoader, got {type(dataloader).__name__}.")
    if dispatch_batches is None:
        dispatch_batches = bool(put_on_device) and isinstance(dataloader.dataset, IterableDataset)
    if dispatch_batches and not put_on_device:
        raise ConfigError(
            "dispatch_batches=True places the dispatched batches on the device, so it needs put_on_device=True "
            "(Accelerator.prepare passes it)."
        )
    return dispatch_batches


@dataclasses.dataclass(frozen=True)
class Sharing:
    """Whom a prepared loader serves: the processes its batches are shared between and this one's index among them
    (the data-parallel ranks), the process state it asks for its device and main process (a ``PartialState`` or
    ``AcceleratorState``), and the :class:`~hasten.state.GradientState` its iterations register with.

    ``Accelerator.prepare_data_loader`` hands in its own; :func:`prepare_data_loader` alone uses the process's.
    """

    num_processes: int
    process_index: int
    state: Any
    gradient_state: GradientState

    def loader_kwargs(self) -> dict[str, Any]:
        """The private arguments a prepared loader takes the states by."""
        return {"_state": self.state, "_gradient_state": self.gradient_state}


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
    ``even_batches``, ``use_seedable_sampler``, ``data_seed`` and ``non_blocking``; the module docstring
    says which random draws happen where (Accelerate's). Beyond Accelerate: every rank shuffles the same
    way (rank 0's sampler generator or seed is shared at each epoch start, whatever ``rng_types`` says),
    and a loader with more than one process that is already sharded (a ``DistributedSampler``, or an
    ``IterableDataset`` marked ``hasten_sharded = True`` / split by node) is not sharded again.

    Args:
        dataloader: the loader to prepare.
        device: where batches go when ``put_on_device``.
        num_processes, process_index: default to the current process state.
        rng_types: generators synchronised at each epoch start (``"torch"``, ``"cuda"``, ``"generator"``;
            the last leaves the list when there is nothing to synchronise, as in Accelerate).
        dispatch_batches: None means True for an ``IterableDataset`` placed on the device, as in Accelerate.
        slice_fn_for_dispatch: how a dispatched global batch is cut (see :class:`DataLoaderDispatcher`).
        use_stateful_dataloader: recorded on the returned loader (its ``use_stateful_dataloader``), as in
            Accelerate; every prepared loader records its position either way.
        torch_device_mesh: accepted for compatibility: hasten's loaders shard by data-parallel rank only.
    """
    dispatch_batches = _dispatches(dataloader, dispatch_batches, put_on_device)  # checked before any state is read
    sharing = Sharing(  # no Accelerator hands its own in: the process's (its PartialState read only if needed)
        num_processes if num_processes is not None else PROCESS_STATE.num_processes,
        process_index if process_index is not None else PROCESS_STATE.process_index,
        PROCESS_STATE,
        GradientState(),
    )
    return prepare_loader_for(
        sharing,
        dataloader,
        device,
        split_batches=split_batches,
        put_on_device=put_on_device,
        rng_types=rng_types,
        dispatch_batches=dispatch_batches,
        even_batches=even_batches,
        slice_fn_for_dispatch=slice_fn_for_dispatch,
        use_seedable_sampler=use_seedable_sampler,
        data_seed=data_seed,
        non_blocking=non_blocking,
        use_stateful_dataloader=use_stateful_dataloader,
    )


def prepare_loader_for(
    sharing: Sharing,
    dataloader: DataLoader,
    device=None,
    *,
    split_batches: bool,
    put_on_device: bool,
    rng_types,
    dispatch_batches: bool | None,
    even_batches: bool,
    slice_fn_for_dispatch,
    use_seedable_sampler: bool,
    data_seed: int | None,
    non_blocking: bool,
    use_stateful_dataloader: bool,
) -> DataLoader:
    """:func:`prepare_data_loader` for ``sharing`` (the Accelerator's data-parallel ranks and states), with the same
    options."""
    dispatch_batches = _dispatches(dataloader, dispatch_batches, put_on_device)
    iterable = isinstance(dataloader.dataset, IterableDataset)
    world, rank = sharing.num_processes, sharing.process_index
    if split_batches:
        _check_split_batches(dataloader, world)
    device = device if put_on_device else None
    kwargs = {**_loader_kwargs(dataloader), **sharing.loader_kwargs()}  # every loader built below takes both
    if world > 1 and _user_sharded(dataloader):
        return _recording(_keep_user_sharding(dataloader, world, device, non_blocking, kwargs), use_stateful_dataloader)
    sampler = get_sampler(dataloader)
    seedable = (
        _seedable_sampler(sampler, data_seed, world)
        if use_seedable_sampler and isinstance(sampler, RandomSampler)
        else None
    )
    if dispatch_batches:
        kwargs.pop("generator", None)
        prepared = _dispatcher(
            dataloader, split_batches, even_batches, device, non_blocking, slice_fn_for_dispatch, kwargs
        )
    elif iterable:
        prepared = _iterable_loader(dataloader, world, rank, split_batches, device, non_blocking, rng_types, kwargs)
    else:
        generator = (
            _generator_to_share(sampler)
            if world > 1 and not use_seedable_sampler and hasattr(sampler, "generator")
            else None
        )
        prepared = _map_style_loader(
            dataloader, world, rank, split_batches, even_batches, device, non_blocking, rng_types, generator, kwargs
        )
    if seedable is not None:
        _install_sampler(prepared, seedable)
    return _recording(prepared, use_stateful_dataloader)


def _recording(loader, use_stateful_dataloader: bool):
    """``loader`` carrying the ``use_stateful_dataloader`` it was prepared with, as Accelerate's loaders do."""
    loader.use_stateful_dataloader = bool(use_stateful_dataloader)
    return loader


def _without_generator_sync(rng_types, generator):
    """Accelerate's rule: ``"generator"`` leaves ``rng_types`` (the caller's list, in place) when there is no
    generator to synchronise."""
    if rng_types is not None and generator is None and "generator" in rng_types:
        rng_types.remove("generator")
    return rng_types


def _map_style_loader(
    dataloader, world, rank, split_batches, even_batches, device, non_blocking, rng_types, generator, kwargs
) -> DataLoaderShard:
    batch_sampler = _batch_sampler_of(dataloader)
    rng_types = _without_generator_sync(rng_types, generator)
    local = _per_process(_batch_size_of(dataloader), world, split_batches)
    if batch_sampler is None:  # batch_size=None with a plain sampler: one sample at a time (one process only)
        if world > 1:
            raise ConfigError(
                "prepare() shards map-style DataLoaders that batch (batch_size set, a batch_sampler, or a "
                "BatchSampler given as sampler with batch_size=None); this one has batch_size=None and a plain sampler."
            )
        return DataLoaderShard(
            dataloader.dataset,
            device=device,
            rng_types=rng_types,
            sampler=dataloader.sampler,
            batch_size=None,
            _non_blocking=non_blocking,
            _drop_last=dataloader.drop_last,
            **kwargs,
        )
    if world > 1:
        sharder = BatchSamplerShard(batch_sampler, world, rank, split_batches, even_batches)
    else:  # Accelerate keeps one process's batches as they are; the wrapper lets a resumed epoch skip batches unloaded
        sharder = PassThroughBatchSampler(batch_sampler, split_batches, even_batches)
    # a BatchSampler given as `sampler` (batch_size=None) stays in that place, as Accelerate keeps it
    placement = (
        {"batch_sampler": sharder} if dataloader.batch_sampler is not None else {"sampler": sharder, "batch_size": None}
    )
    return DataLoaderShard(
        dataloader.dataset,
        device=device,
        rng_types=rng_types,
        synchronized_generator=generator,
        **placement,
        _non_blocking=non_blocking,
        _drop_last=dataloader.drop_last,
        _sharder=sharder,
        _local_batch_size=local,
        _num_processes=world,
        **kwargs,
    )


def _iterable_loader(
    dataloader, world, rank, split_batches, device, non_blocking, rng_types, kwargs
) -> DataLoaderShard:
    """An ``IterableDataset`` read whole on every process, each keeping its share (one process: read as it is)."""
    dataset, size = dataloader.dataset, dataloader.batch_size
    if world == 1:
        rng_types = _without_generator_sync(rng_types, None)
        return DataLoaderShard(
            dataset,
            device=device,
            rng_types=rng_types,
            batch_size=size,
            drop_last=dataloader.drop_last,
            _non_blocking=non_blocking,
            _drop_last=dataloader.drop_last,
            _local_batch_size=size,
            **kwargs,
        )
    shards = _datasets_shard(dataset, world, rank, split_batches)
    if shards is not None:
        return DataLoaderShard(
            shards,
            device=device,
            rng_types=_without_generator_sync(rng_types, None),
            batch_size=size,
            drop_last=dataloader.drop_last,
            _non_blocking=non_blocking,
            _drop_last=dataloader.drop_last,
            _local_batch_size=size,
            _num_processes=world,
            **kwargs,
        )
    generator = getattr(dataset, "generator", None)
    rng_types = _without_generator_sync(rng_types, generator)
    # batch_size=None: the dataset yields whole batches, dealt to the processes in turn
    shard = IterableDatasetShard(
        dataset,
        batch_size=size,
        drop_last=dataloader.drop_last,
        num_processes=world,
        process_index=rank,
        split_batches=split_batches,
    )
    local = _per_process(size, world, split_batches)
    return DataLoaderShard(
        shard,
        device=device,
        rng_types=rng_types,
        synchronized_generator=generator,
        batch_size=local,
        drop_last=dataloader.drop_last,
        _non_blocking=non_blocking,
        _drop_last=dataloader.drop_last,
        _sharder=shard,
        _num_processes=world,
        **kwargs,
    )


def _datasets_shard(dataset, world: int, rank: int, split_batches: bool):
    """A 🤗 ``datasets.IterableDataset`` with at least one shard per process is split by shards, as in Accelerate."""
    try:
        from datasets import IterableDataset as DatasetsIterableDataset
    except ImportError:
        return None
    if isinstance(dataset, DatasetsIterableDataset) and not split_batches and dataset.n_shards >= world:
        return dataset.shard(num_shards=world, index=rank)
    return None


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
            f"split_batches=True cuts each batch of {size} into {world} pieces, so the batch size must be a multiple "
            f"of the number of processes ({world}). Use a batch size of {world * max(size // world, 1)} or "
            f"{world * (size // world + 1)}, or split_batches=False (each process then loads whole batches of {size})."
        )


def _batch_sampler_of(dataloader: DataLoader):
    """The loader's batch sampler, or the ``BatchSampler`` it was given as ``sampler`` (with ``batch_size=None``)."""
    if dataloader.batch_sampler is not None:
        return dataloader.batch_sampler
    return dataloader.sampler if isinstance(dataloader.sampler, BatchSampler) else None


def _batch_size_of(dataloader: DataLoader) -> int | None:
    return (
        dataloader.batch_size
        if dataloader.batch_size is not None
        else getattr(_batch_sampler_of(dataloader), "batch_size", None)
    )


def _per_process(size: int | None, world: int, split_batches: bool) -> int | None:
    if size is None:
        return None
    return size // world if split_batches else size


def _dispatcher(
    dataloader, split_batches, even_batches, device, non_blocking, slice_fn, kwargs
) -> DataLoaderDispatcher:
    size = dataloader.batch_size or getattr(dataloader.batch_sampler, "batch_size", None)
    if size is None:
        raise ConfigError(
            "dispatch_batches=True needs a DataLoader with a batch_size (or a batch sampler that has one)."
        )
    if isinstance(dataloader.dataset, IterableDataset):
        kwargs.update(batch_size=dataloader.batch_size, drop_last=dataloader.drop_last)
    else:
        kwargs["batch_sampler"] = _batch_sampler_of(dataloader)
    drop_last = getattr(dataloader.batch_sampler, "drop_last", dataloader.drop_last)
    return DataLoaderDispatcher(
        dataloader.dataset,
        split_batches=split_batches,
        even_batches=even_batches,
        device=device,
        _non_blocking=non_blocking,
        slice_fn=slice_fn,
        _batch_size=size,
        _drop_last=drop_last,
        **kwargs,
    )


def _keep_user_sharding(dataloader: DataLoader, world: int, device, non_blocking: bool, kwargs: dict) -> DataLoader:
    """A loader already sharded between processes (a ``DistributedSampler``, a self-sharding dataset), kept as is."""
    warn_once(
        "user-sharded",
        "This dataloader is already sharded between processes (DistributedSampler or a self-sharding dataset); "
        "hasten keeps it as is and does not shard it again.",
    )
    sizes = {"_local_batch_size": _batch_size_of(dataloader), "_num_processes": world}
    if isinstance(dataloader.dataset, IterableDataset):
        return DataLoaderShard(
            dataloader.dataset,
            device=device,
            batch_size=dataloader.batch_size,
            drop_last=dataloader.drop_last,
            _non_blocking=non_blocking,
            _drop_last=dataloader.drop_last,
            **sizes,
            **kwargs,
        )
    return DataLoaderShard(
        dataloader.dataset,
        device=device,
        batch_sampler=dataloader.batch_sampler,
        _non_blocking=non_blocking,
        _drop_last=dataloader.drop_last,
        **sizes,
        **kwargs,
    )
