"""Data loading across 2 real processes: sharding, shuffling, lengths, gather_for_metrics, dispatch, resume.

Run by tests/runtime/test_distributed.py under a 2-process launch; exits non-zero at the first failure.
"""

import warnings

import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from hasten import Accelerator, DataLoaderConfiguration
from hasten.runtime.operations import gather_object

accelerator = Accelerator()
N, RANK = accelerator.num_processes, accelerator.process_index
assert N == 2, f"expected 2 processes, got {N}"


def dataset(n):
    return TensorDataset(torch.arange(n))


def all_ranks(values):
    """The values of every rank, as a list indexed by rank."""
    return gather_object([values])


def check_sharding_and_shuffle():
    loader = accelerator.prepare(DataLoader(dataset(40), batch_size=4, shuffle=True))
    assert len(loader) == 5, f"len after prepare: {len(loader)} (40 samples, batch 4, 2 processes -> 5)"
    epochs = []
    for epoch in range(3):
        mine = [int(i) for (batch,) in loader for i in batch]
        everyone = all_ranks(mine)
        assert not set(everyone[0]) & set(everyone[1]), f"epoch {epoch}: ranks share samples"
        assert sorted(everyone[0] + everyone[1]) == list(range(40)), f"epoch {epoch}: ranks do not cover the dataset"
        # rank r gets batches r, r+2, ... of one common order: rebuild the order from both ranks.
        order = [x for pair in zip(*(zip(*[iter(e)] * 4) for e in everyone)) for b in pair for x in b]
        epochs.append(order)
    assert len({tuple(o) for o in epochs}) == 3, "the shuffle did not change between epochs"
    assert loader.iteration == 3


def check_gather_for_metrics():
    configs = [
        ("even", DataLoaderConfiguration(even_batches=True)),
        ("uneven", DataLoaderConfiguration(even_batches=False)),
        ("split", DataLoaderConfiguration(split_batches=True)),
    ]
    for label, config in configs:
        acc = Accelerator()
        acc.dataloader_config = config
        for n in (1, 7, 64, 101):
            for batch_size in (1, 4, 16):
                if label == "split" and batch_size % 2:
                    continue
                loader = acc.prepare(DataLoader(dataset(n), batch_size=batch_size))
                if label == "uneven":  # a rank may have one batch fewer (Accelerate's layout): gather after the loop
                    seen = acc.gather_for_metrics([batch * 10 for (batch,) in loader])
                else:
                    seen = [acc.gather_for_metrics(batch * 10) for (batch,) in loader]
                got = torch.cat(seen).tolist()
                assert got == [10 * i for i in range(n)], (
                    f"{label} n={n} bs={batch_size}: gather_for_metrics gave {got}"
                )
                expected = [f"s{i}" for i in range(n)]
                if label == "uneven":  # objects gathered after the loop come in rank order: each sample once
                    objects = acc.gather_for_metrics(
                        [f"s{int(i)}" for (batch,) in loader for i in batch], use_gather_object=True
                    )
                    objects, expected = sorted(objects), sorted(expected)
                else:
                    objects = [
                        o
                        for (batch,) in loader
                        for o in acc.gather_for_metrics([f"s{int(i)}" for i in batch], use_gather_object=True)
                    ]
                assert objects == expected, f"{label} n={n} bs={batch_size}: objects {objects}"


def check_lengths():
    for n, bs, even, expected in [
        (101, 16, True, (4, 4)),
        (101, 16, False, (4, 3)),
        (64, 16, True, (2, 2)),
        (7, 4, False, (1, 1)),
    ]:
        acc = Accelerator()
        acc.even_batches = even
        loader = acc.prepare(DataLoader(dataset(n), batch_size=bs))
        expected = expected[acc.process_index]
        assert len(loader) == expected, f"n={n} bs={bs} even={even}: len {len(loader)} != {expected}"
        assert sum(1 for _ in loader) == expected
    acc = Accelerator()
    loader = acc.prepare(DataLoader(dataset(10), batch_size=4, drop_last=True))
    assert len(loader) == 1 and sum(1 for _ in loader) == 1, "drop_last: one full round of 2 batches"


def check_split_batches_layout():
    acc = Accelerator(split_batches=True)
    loader = acc.prepare(DataLoader(dataset(16), batch_size=8))
    batches = [b.tolist() for (b,) in loader]
    expected = [[0, 1, 2, 3], [8, 9, 10, 11]] if RANK == 0 else [[4, 5, 6, 7], [12, 13, 14, 15]]
    assert batches == expected, f"split_batches layout on rank {RANK}: {batches}"


class Stream(IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(torch.arange(self.n))

    def __len__(self):
        return self.n


def check_dispatch_and_iterable():
    for dispatch in (True, False):
        acc = Accelerator(dataloader_config=DataLoaderConfiguration(dispatch_batches=dispatch))
        loader = acc.prepare(DataLoader(Stream(23), batch_size=4))
        mine, gathered = [], []
        for batch in loader:
            mine += batch.tolist()
            gathered.append(acc.gather_for_metrics(batch))
        everyone = all_ranks(mine)
        assert not set(everyone[0]) - set(range(23)), "iterable shard returned unknown samples"
        got = torch.cat(gathered).tolist()
        # dispatched: the padding is dropped; sharded: Accelerate's remainder for an iterable shard is 0, so the
        # last round's padding from the first batch stays (as in Accelerate: tests/compat/test_differential_loop.py)
        assert got[:23] == list(range(23)) and (len(got) == 23 if dispatch else set(got[23:]) <= set(range(8))), (
            f"dispatch={dispatch}: {got}"
        )
    acc = Accelerator(dataloader_config=DataLoaderConfiguration(dispatch_batches=True))
    calls = []

    def take_rows(batch, rows, process_index, num_processes):
        calls.append((rows.start, rows.stop, process_index, num_processes))
        return batch[rows]

    loader = acc.prepare_data_loader(DataLoader(Stream(8), batch_size=2), slice_fn_for_dispatch=take_rows)
    got = [b.tolist() for b in loader]
    assert got == ([[0, 1], [4, 5]] if RANK == 0 else [[2, 3], [6, 7]]), f"slice_fn_for_dispatch: {got}"
    assert calls == [(2 * RANK, 2 * RANK + 2, RANK, 2)] * 2, f"slice_fn_for_dispatch calls: {calls}"
    strings = [{"x": torch.tensor([i]), "name": f"n{i}"} for i in range(8)]
    loader = acc.prepare(DataLoader(strings, batch_size=2))
    names = [n for batch in loader for n in batch["name"]]
    everyone = all_ranks(names)
    assert sorted(everyone[0] + everyone[1]) == sorted(f"n{i}" for i in range(8)), (
        f"dispatch of non-tensors: {everyone}"
    )


def check_resume_position():
    acc = Accelerator()
    loader = acc.prepare(DataLoader(dataset(32), batch_size=2, shuffle=True))
    loader.set_epoch(4)
    full = []
    for i, (b,) in enumerate(loader):
        full.append(b.tolist())
        if i == 2:
            state = loader.state_dict()
    assert state["epoch"] == 4 and state["batches_yielded"] == 3 and "rng" in state, f"state_dict {sorted(state)}"
    other = acc.prepare(
        DataLoader(dataset(32), batch_size=2, shuffle=True)
    )  # its own generator: the state replays the epoch
    other.load_state_dict(state)
    before = torch.get_rng_state()
    rest = [b.tolist() for (b,) in other]
    assert rest == full[3:], f"resumed epoch differs: {rest} vs {full[3:]}"
    assert torch.get_rng_state().equal(before), "resuming drew from the global torch generator"
    assert other.iteration == 5
    view = acc.skip_first_batches(other, 6)
    assert len(view) == len(other) - 6
    assert [b.tolist() for (b,) in view] != [], "skip view yielded nothing"


def check_user_sharded():
    data = dataset(20)
    sampler = DistributedSampler(data, num_replicas=N, rank=RANK, shuffle=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = accelerator.prepare(DataLoader(data, batch_size=5, sampler=sampler))
    assert any("already sharded" in str(w.message) for w in caught), "no warning for a DistributedSampler loader"
    mine = [int(i) for (b,) in loader for i in b]
    assert mine == list(range(RANK, 20, 2)), f"user-sharded loader was re-sharded: {mine}"


def check_end_of_dataloader():
    acc = Accelerator()
    loader = acc.prepare(DataLoader(dataset(12), batch_size=2))
    flags = [acc.gradient_state.end_of_dataloader for _ in loader]
    assert flags == [False, False, True], f"end_of_dataloader flags {flags}"
    assert acc.gradient_state.active_dataloader is None


for check in (
    check_sharding_and_shuffle,
    check_gather_for_metrics,
    check_lengths,
    check_split_batches_layout,
    check_dispatch_and_iterable,
    check_resume_position,
    check_user_sharded,
    check_end_of_dataloader,
):
    check()
    accelerator.wait_for_everyone()
accelerator.print("data loading checks passed")
