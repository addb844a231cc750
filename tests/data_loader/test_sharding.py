"""Sharding layouts computed in one process for every rank."""

import numpy as np
import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, SequentialSampler

from hasten.data_loader import (
    BatchSamplerShard,
    FinalRound,
    IterableDatasetShard,
    SeedableRandomSampler,
    SkipBatchSampler,
    prepare_data_loader,
)
from hasten.errors import ConfigError


def shards(n, bs, world=2, drop_last=False, **kwargs):
    base = BatchSampler(SequentialSampler(range(n)), bs, drop_last)
    out = []
    for rank in range(world):
        sampler = BatchSamplerShard(base, world, rank, **kwargs)
        out.append((list(sampler), sampler.final_round, len(sampler)))
    return out


def test_round_robin_with_even_batches_cycles_from_the_start():
    (r0, f0, l0), (r1, _, l1) = shards(10, 4)
    assert r0 == [[0, 1, 2, 3], [8, 9, 0, 1]]
    assert r1 == [[4, 5, 6, 7], [2, 3, 4, 5]]
    assert (f0.real, f0.sizes, f0.padded) == (2, (4, 4), True)
    assert l0 == l1 == 2


def test_uneven_batches_keep_accelerates_layout_and_never_duplicate():
    """even_batches=False: the leftover batches go to the first ranks, a rank with nothing left gets no
    batch (Accelerate's BatchSamplerShard layout, which its own tests and join_uneven_inputs expect)."""
    (r0, f0, l0), (r1, _, l1) = shards(11, 4, even_batches=False)
    assert r0 == [[0, 1, 2, 3], [8, 9, 10]] and r1 == [[4, 5, 6, 7]] and (l0, l1) == (2, 1)
    assert (f0.real, f0.sizes, f0.padded) == (3, (3, 0), False)
    (r0, f0, _), (r1, _, _) = shards(13, 4, even_batches=False)
    assert r0 == [[0, 1, 2, 3], [8, 9, 10, 11]] and r1 == [[4, 5, 6, 7], [12]] and f0.sizes == (4, 1)
    (r0, f0, l0), (r1, _, l1) = shards(1, 4, even_batches=False)
    assert r0 == [[0]] and r1 == [] and (l0, l1) == (1, 0)
    base = BatchSampler(SequentialSampler(range(11)), 4, False)
    assert [BatchSamplerShard(base, 2, r, even_batches=False).rounds for r in (0, 1)] == [2, 2], (
        "rounds: the same on every rank"
    )
    assert not hasattr(SkipBatchSampler(base, 1), "rounds")


def test_dataset_smaller_than_one_round():
    (r0, f0, _), (r1, _, _) = shards(3, 4)
    assert r0 == [[0, 1, 2, 0]] and r1 == [[1, 2, 0, 1]] and f0.real == 3


def test_complete_last_round_is_not_padded():
    (r0, f0, l0), _ = shards(16, 4)
    assert len(r0) == l0 == 2 and (f0.real, f0.padded) == (8, False)


def test_drop_last_drops_the_incomplete_round():
    (r0, f0, l0), (r1, _, l1) = shards(14, 4, drop_last=True)
    assert r0 == [[0, 1, 2, 3]] and r1 == [[4, 5, 6, 7]] and l0 == l1 == 1


def test_split_batches():
    (r0, f0, l0), (r1, _, _) = shards(10, 4, split_batches=True)
    assert r0 == [[0, 1], [4, 5], [8, 9]] and r1 == [[2, 3], [6, 7], [0, 1]]
    assert (f0.real, f0.sizes, f0.padded, l0) == (2, (2, 2), True, 3)
    (r0, f0, _), (r1, _, _) = shards(10, 4, split_batches=True, even_batches=False)
    assert r0 == [[0, 1], [4, 5], [8, 9]] and r1 == [[2, 3], [6, 7]] and f0.sizes == (2, 0)
    (r0, f0, _), (r1, _, _) = shards(7, 4, split_batches=True, even_batches=False)
    assert r0[-1] == [4, 5] and r1[-1] == [6] and f0.sizes == (2, 1)


def test_split_batches_needs_a_divisible_batch_size():
    with pytest.raises(ConfigError, match="batch_size divisible by 2; got batch_size=3 from BatchSampler"):
        shards(10, 3, split_batches=True)
    # A batch sampler without a batch size cannot be split either (Accelerate's condition).
    with pytest.raises(ConfigError, match="got batch_size=None from list"):
        BatchSamplerShard([[0, 1], [2, 3]], 2, 0, split_batches=True)


def test_four_processes_cover_everything_exactly_once_when_uneven():
    parts = shards(23, 2, world=4, even_batches=False)
    seen = sorted(i for batches, _, _ in parts for b in batches for i in b)
    assert seen == list(range(23))
    assert len({len(batches) for batches, _, _ in parts}) == 1, "every rank gets the same number of batches"


def test_iterable_dataset_shard_completes_the_last_buffer_from_the_first_as_accelerate_does():
    got = [list(IterableDatasetShard(range(10), batch_size=2, num_processes=2, process_index=r)) for r in (0, 1)]
    assert got == [[0, 1, 4, 5, 8, 9], [2, 3, 6, 7, 0, 1]]
    shards = [IterableDatasetShard(range(9), batch_size=2, num_processes=2, process_index=r) for r in (0, 1)]
    assert [list(s) for s in shards] == [[0, 1, 4, 5, 8, 0], [2, 3, 6, 7, 1, 2]]
    assert shards[0].final_round == FinalRound(1, (2, 2), padded=True)
    alone = IterableDatasetShard(range(5), batch_size=2)
    assert list(alone) == [0, 1, 2, 3, 4, 0], "one process too (prepare does not shard then)"
    assert list(IterableDatasetShard(range(5), batch_size=2, drop_last=True)) == [0, 1, 2, 3]


def test_seedable_sampler_depends_on_seed_and_epoch_only():
    a, b = SeedableRandomSampler(range(20), data_seed=5), SeedableRandomSampler(range(20), data_seed=5)
    first = list(a)
    assert first == list(b) and a.epoch == b.epoch == 1, "a full pass moves to the next epoch, as in Accelerate"
    second = list(a)
    assert second != first and sorted(second) == list(range(20))
    a.set_epoch(0)
    assert list(a) == first


def test_seedable_sampler_seeds_from_the_global_seed_by_default():
    """Without data_seed the order follows set_seed (torch.initial_seed()), as Accelerate's sampler does."""
    torch.manual_seed(42)
    a = SeedableRandomSampler(range(20))
    torch.manual_seed(7)
    b = SeedableRandomSampler(range(20))
    torch.manual_seed(42)
    c = SeedableRandomSampler(range(20))
    assert a.initial_seed == c.initial_seed == 42 and b.initial_seed == 7 and list(a) == list(c)


def test_skip_batch_sampler():
    base = BatchSampler(SequentialSampler(range(10)), 3, False)
    skip = SkipBatchSampler(base, 2)
    assert list(skip) == [[6, 7, 8], [9]] and len(skip) == 2


class _CustomBatchSampler:
    """Not a torch BatchSampler: shuffles with numpy, like Accelerate's own custom-sampler check."""

    def __init__(self, length, batch_size):
        self.batch_size, self.length, self.epoch = batch_size, length, 0

    def __iter__(self):
        order = np.random.default_rng(self.epoch).permutation(self.length)
        yield from (order[i : i + self.batch_size].tolist() for i in range(0, self.length, self.batch_size))

    def __len__(self):
        return -(-self.length // self.batch_size)

    def set_epoch(self, epoch):
        self.epoch = epoch


class _MyRandomSampler(RandomSampler):
    """A user's shuffling sampler: a subclass of RandomSampler that prepare must not replace."""


@pytest.mark.parametrize("world", [1, 2])
def test_custom_samplers_and_batch_samplers_are_kept(world):
    custom = _CustomBatchSampler(16, 4)
    prepared = [
        prepare_data_loader(DataLoader(list(range(16)), batch_sampler=custom), num_processes=world, process_index=r)
        for r in range(world)
    ]
    assert all(p.batch_sampler.batch_sampler is custom for p in prepared), (
        "Accelerate's check: dl.batch_sampler.batch_sampler is the user's"
    )
    assert sorted(x for p in prepared for batch in p for x in batch.tolist()) == list(range(16))
    samplers = [_MyRandomSampler(range(16)) for _ in range(world)]
    loaders = []
    for rank in range(world):  # each rank seeds the same way, as set_seed does in a real launch
        torch.manual_seed(5)
        loader = DataLoader(list(range(16)), sampler=samplers[rank], batch_size=4)
        loaders.append(prepare_data_loader(loader, num_processes=world, process_index=rank))
    assert all(loader.batch_sampler.batch_sampler.sampler is sampler for loader, sampler in zip(loaders, samplers))
    # with several processes the sampler gets a generator seeded at prepare (rank 0's is shared at each epoch start),
    # so every rank shuffles the same way and the shards cover the data once
    assert all((sampler.generator is not None) == (world > 1) for sampler in samplers)
    assert sorted(x for loader in loaders for batch in loader for x in batch.tolist()) == list(range(16))


def test_set_epoch_reaches_a_custom_batch_sampler_at_once():
    custom = _CustomBatchSampler(16, 4)
    loader = prepare_data_loader(DataLoader(list(range(16)), batch_sampler=custom), num_processes=2, process_index=0)
    loader.set_epoch(3)
    assert custom.epoch == 3
    first = [b.tolist() for b in loader]
    loader.set_epoch(3)
    assert [b.tolist() for b in loader] == first


def test_iterable_shard_with_no_batch_size_deals_whole_batches():
    dataset = _Batches()
    assert [t.tolist() for t in IterableDatasetShard(dataset, batch_size=None, num_processes=2, process_index=1)] == [
        [1, 1],
        [3, 3],
        [0, 0],
    ]
    for rank, expected in ((0, [[0, 0], [2, 2], [4, 4]]), (1, [[1, 1], [3, 3], [0, 0]])):
        loader = prepare_data_loader(
            DataLoader(dataset, batch_size=None), num_processes=2, process_index=rank, dispatch_batches=False
        )
        assert [t.tolist() for t in loader] == expected  # each element stays a batch: no collation, no extra dimension
    alone = prepare_data_loader(DataLoader(dataset, batch_size=None))
    assert [t.tolist() for t in alone] == [[i, i] for i in range(5)]  # one process: nothing duplicated
    with pytest.raises(ConfigError, match="needs a batch_size divisible by 2; got None"):
        IterableDatasetShard(dataset, batch_size=None, num_processes=2, split_batches=True)


def test_split_batches_refuses_batches_that_do_not_divide_before_sharding():
    with pytest.raises(ConfigError, match=r"cuts each batch of 3 into 2 pieces.*Use a batch size of 2 or 4"):
        prepare_data_loader(
            DataLoader(list(range(12)), batch_size=3), num_processes=2, process_index=0, split_batches=True
        )
    with pytest.raises(ConfigError, match="has batch_size=None and its batch sampler \\(list\\) has no `batch_size`"):
        prepare_data_loader(
            DataLoader(list(range(4)), batch_sampler=[[0, 1], [2, 3]]),
            num_processes=2,
            process_index=0,
            split_batches=True,
        )
    with pytest.raises(ConfigError, match="cuts each batch of 3 into 2 pieces"):
        prepare_data_loader(
            DataLoader(_Batches(), batch_size=3),
            num_processes=2,
            process_index=0,
            split_batches=True,
            dispatch_batches=False,
        )


class _Batches(IterableDataset):
    def __iter__(self):
        yield from (torch.tensor([i, i]) for i in range(5))


def test_base_dataloader_is_the_loader_itself_and_no_class_attribute():
    from hasten.data_loader import DataLoaderDispatcher, DataLoaderShard, SkipDataLoader

    for cls, kwargs in ((SkipDataLoader, {"skip_batches": 2}), (DataLoaderShard, {}), (DataLoaderDispatcher, {})):
        loader = cls(range(16), batch_size=4, **kwargs)
        assert loader.base_dataloader is loader and isinstance(loader.base_dataloader, DataLoader)
        with pytest.raises(AttributeError):
            _ = cls.base_dataloader


def test_split_batches_refuses_a_batch_size_that_does_not_divide():
    with pytest.raises(ValueError, match="round multiple of 2"):
        BatchSamplerShard(BatchSampler(range(20), batch_size=3, drop_last=False), 2, 0, split_batches=True)


def test_a_plain_loader_after_skip_first_batches_prepares_with_dispatch_and_pickles():
    import pickle

    from hasten import Accelerator, DataLoaderConfiguration, skip_first_batches

    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(dispatch_batches=True))
    skipped = skip_first_batches(DataLoader(torch.utils.data.TensorDataset(torch.arange(10))), 2)
    assert skipped.batch_sampler.batch_size == 1 and skipped.batch_sampler.drop_last is False
    prepared = accelerator.prepare(skipped)
    assert [batch[0].tolist() for batch in prepared] == [[i] for i in range(2, 10)]
    assert len(pickle.loads(pickle.dumps(accelerator))._dataloaders) == 1


def test_prepared_loaders_carry_the_use_stateful_dataloader_they_were_prepared_with():
    from hasten import Accelerator, DataLoaderConfiguration
    from hasten.data_loader import DataLoaderShard

    loader = DataLoader(range(8), batch_size=2)
    assert prepare_data_loader(loader).use_stateful_dataloader is False
    assert prepare_data_loader(loader, use_stateful_dataloader=True).use_stateful_dataloader is True
    assert DataLoaderShard(range(8), batch_size=2).use_stateful_dataloader is False
    for stateful in (False, True):
        config = DataLoaderConfiguration(use_stateful_dataloader=stateful, dispatch_batches=stateful)
        prepared = Accelerator(cpu=True, dataloader_config=config).prepare(loader)
        assert prepared.use_stateful_dataloader is stateful
