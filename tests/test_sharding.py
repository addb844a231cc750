"""Sharding layouts computed in one process for every rank."""

import pytest
from torch.utils.data import BatchSampler, SequentialSampler

from hasten.data_loader import BatchSamplerShard, IterableDatasetShard, SeedableRandomSampler, SkipBatchSampler
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


def test_uneven_batches_split_the_leftover_and_never_duplicate():
    (r0, f0, _), (r1, _, _) = shards(11, 4, even_batches=False)
    assert r0 == [[0, 1, 2, 3], [8, 9]] and r1 == [[4, 5, 6, 7], [10]]
    assert (f0.real, f0.sizes, f0.padded) == (3, (2, 1), False)
    (r0, f0, _), (r1, _, _) = shards(1, 4, even_batches=False)
    assert r0 == [[0]] and r1 == [[]], "a rank with no data gets an empty batch, so loops stay in step"


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
    assert r0[-1] == [8] and r1[-1] == [9] and f0.sizes == (1, 1)


def test_split_batches_needs_a_divisible_batch_size():
    with pytest.raises(ConfigError, match="batch size 3 for 2 processes"):
        shards(10, 3, split_batches=True)


def test_four_processes_cover_everything_exactly_once_when_uneven():
    parts = shards(23, 2, world=4, even_batches=False)
    seen = sorted(i for batches, _, _ in parts for b in batches for i in b)
    assert seen == list(range(23))
    assert len({len(batches) for batches, _, _ in parts}) == 1, "every rank gets the same number of batches"


def test_iterable_dataset_shard():
    for even, expected0, expected1 in [(True, [0, 1, 4, 5, 8, 9], [2, 3, 6, 7, 0, 1]), (False, [0, 1, 4, 5, 8], [2, 3, 6, 7, 9])]:
        got = [list(IterableDatasetShard(range(10), batch_size=2, num_processes=2, process_index=r, even_batches=even)) for r in (0, 1)]
        assert got == [expected0, expected1], (even, got)
    # fewer leftover samples than processes: completed in both modes so no process runs one batch short
    got = [list(IterableDatasetShard(range(9), batch_size=2, num_processes=2, process_index=r, even_batches=False)) for r in (0, 1)]
    assert got == [[0, 1, 4, 5, 8, 0], [2, 3, 6, 7, 1, 2]]


def test_seedable_sampler_depends_on_seed_and_epoch_only():
    a, b = SeedableRandomSampler(range(20), data_seed=5), SeedableRandomSampler(range(20), data_seed=5)
    assert list(a) == list(b)
    first = list(a)
    a.set_epoch(1)
    assert list(a) != first and sorted(a) == list(range(20))


def test_skip_batch_sampler():
    base = BatchSampler(SequentialSampler(range(10)), 3, False)
    skip = SkipBatchSampler(base, 2)
    assert list(skip) == [[6, 7, 8], [9]] and len(skip) == 2
