"""Loader positions in one process: every rank of a run is a loader built with its ``process_index``, iterated in
lockstep, so a state saved on N processes can be resumed on M and the samples of both runs counted."""

from collections import Counter

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from hasten.data_loader import prepare_data_loader
from hasten.data_loader.position import SampleLedger


class Stream(IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))

    def __len__(self):
        return self.n


def build(world, n=50, batch_size=4, shuffle=True, iterable=False, **kwargs):
    """The loaders of every rank of a ``world``-process run. Shuffling uses the seedable sampler, whose order is
    the same on every simulated rank and at any number of processes: a plain shuffling sampler's generator is
    seeded by a global draw at prepare and shared from rank 0 per epoch (as in Accelerate), which ranks simulated
    in one process cannot do (the real-process resumes, tests/checkpointing/test_resume_world_size.py, cover it)."""
    data = Stream(n) if iterable else TensorDataset(torch.arange(n))
    options = {"dispatch_batches": False} if iterable else {"use_seedable_sampler": True, "data_seed": 7}
    return [
        prepare_data_loader(
            DataLoader(data, batch_size=batch_size, shuffle=shuffle and not iterable),
            num_processes=world,
            process_index=rank,
            **options,
            **kwargs,
        )
        for rank in range(world)
    ]


def real_rows(loader, batch, rank):
    """The rows of ``batch`` that are not padding (the padding of the last round is known from its layout)."""
    rows = (batch if torch.is_tensor(batch) else batch[0]).tolist()
    final = loader.final_round
    if loader.end_of_dataloader and final is not None and final.padded:
        keep = min(max(final.real - sum(final.sizes[:rank]), 0), final.sizes[rank])
        rows = rows[:keep]
    return rows


def run(loaders, rounds=None, states=None):
    """Iterate every rank in lockstep; stop after ``rounds`` rounds (saving rank 0's state) or at the end.

    Returns the real samples seen and rank 0's state at the stop (None when the epoch ran out)."""
    iterators = [iter(loader) for loader in loaders]
    live = list(range(len(loaders)))
    seen, done = [], 0
    while live and (rounds is None or done < rounds):
        for rank in list(live):
            batch = next(iterators[rank], None)
            if batch is None:
                live.remove(rank)
                continue
            seen += real_rows(loaders[rank], batch, rank)
        done += 1
        if states is not None:
            states.append(loaders[0].state_dict())
    return seen, (loaders[0].state_dict() if rounds is not None else None)


WORLDS = [(2, 1), (1, 2), (2, 4), (4, 2), (3, 2), (2, 2)]


OPTIONS = {
    "even": {},
    "uneven": {"even_batches": False},
    "split": {"split_batches": True, "batch_size": 8},
    "iterable": {"iterable": True},
    "iterable-uneven": {"iterable": True, "even_batches": False},
}


def _resumes():
    """Every pair of worlds with every option; split_batches only where 8 samples split over both worlds."""
    for name, options in OPTIONS.items():
        for saved, resumed in WORLDS:
            if not (options.get("split_batches") and 8 % max(saved, resumed)):
                yield pytest.param(saved, resumed, options, id=f"{name}-{saved}-{resumed}")


@pytest.mark.parametrize("saved, resumed, options", list(_resumes()))
def test_a_run_resumed_on_another_number_of_processes_sees_each_sample_once(saved, resumed, options):
    n = 50
    rounds_total = len(build(saved, n, **options)[0])
    for stop in range(1, rounds_total):
        first, state = run(build(saved, n, **options), rounds=stop)
        later = build(resumed, n, **options)
        for loader in later:
            loader.load_state_dict(state)
        second, _ = run(later)
        seen, epoch = Counter(first + second), Counter(range(n))
        assert seen == epoch, (
            f"saved after round {stop}: {sorted(seen - epoch)} repeated, {sorted(epoch - seen)} missing"
        )


def test_the_position_is_in_samples_of_the_global_order():
    loaders = build(2, n=16, batch_size=2, shuffle=False)
    _, state = run(loaders, rounds=2)
    assert (state["samples"], state["batches_yielded"], state["num_processes"]) == (8, 2, 2), state
    # The case: resumed on one process, 4 batches follow (not 6).
    alone = build(1, n=16, batch_size=2, shuffle=False)
    alone[0].load_state_dict(state)
    assert [b[0].tolist() for b in alone[0]] == [[8, 9], [10, 11], [12, 13], [14, 15]]


def test_the_next_epoch_has_the_same_order_at_any_number_of_processes():
    orders = {}
    for world in (1, 2, 4):
        loaders = build(world, n=48, batch_size=2)
        for loader in loaders:
            loader.set_epoch(3)
        seen, _ = run(loaders)
        orders[world] = seen
    # rank-interleaved sample lists differ in layout; the global order is what a 1-process run sees
    assert sorted(orders[2]) == sorted(orders[4]) == list(range(48))
    two = build(2, n=48, batch_size=2)
    one = build(1, n=48, batch_size=2)
    _, state = run(two, rounds=12)  # all of epoch 0 on two processes (inside the loop), then epoch 1 on one
    one[0].load_state_dict(state)
    assert list(one[0]) == [], "the epoch's remaining zero batches"
    reference = build(1, n=48, batch_size=2)
    list(reference[0])
    assert [b[0].tolist() for b in one[0]] == [b[0].tolist() for b in reference[0]], (
        "epoch 1 in the uninterrupted order"
    )


@pytest.mark.parametrize("iterable", [False, True])
def test_a_save_after_the_last_batch_resumes_with_zero_batches_then_the_next_epoch(iterable):
    def epochs(loader, count):
        return [[b.tolist() if torch.is_tensor(b) else b[0].tolist() for b in loader] for _ in range(count)]

    reference = epochs(build(1, n=24, batch_size=4, iterable=iterable)[0], 2)
    loader = build(1, n=24, batch_size=4, iterable=iterable)[0]
    for position, _ in enumerate(loader, 1):
        if position == len(loader):
            inside = loader.state_dict()
    after = loader.state_dict()
    assert inside["epoch"] == 0 and inside["end_of_epoch"] and inside["samples"] == 24, inside
    assert after["epoch"] == 1 and after["samples"] == 0 and not after["end_of_epoch"], after

    resumed = build(1, n=24, batch_size=4, iterable=iterable)[0]
    resumed.load_state_dict(inside)
    assert resumed.state_dict() == inside, "a loaded position is saved again as it was until the loader runs"
    assert epochs(resumed, 2) == [[], reference[1]] and resumed.iteration == 2

    resumed = build(1, n=24, batch_size=4, iterable=iterable)[0]
    resumed.load_state_dict(after)
    assert epochs(resumed, 1) == [reference[1]]


def test_without_a_stateful_loader_the_epoch_after_a_complete_one_is_restored():
    """load_state's default (restore_epoch): a loop that skips by its own step count starts the next epoch."""
    loader = build(1, n=24, batch_size=4)[0]
    for position, _ in enumerate(loader, 1):
        if position == len(loader):
            inside = loader.state_dict()
    resumed = build(1, n=24, batch_size=4)[0]
    resumed.restore_epoch(inside)
    assert resumed.iteration == 1 and len(list(resumed)) == 6


def test_set_epoch_to_another_epoch_drops_a_restored_position():
    loader = build(1, n=24, batch_size=4)[0]
    for position, _ in enumerate(loader, 1):
        if position == 6:
            state = loader.state_dict()
    resumed = build(1, n=24, batch_size=4)[0]
    resumed.load_state_dict(state)
    resumed.set_epoch(0)
    assert list(resumed) == [], "the same epoch: the position stays"
    resumed.load_state_dict(state)
    resumed.set_epoch(1)  # a loop that counts its epochs from its step count (transformers' Trainer) moved on
    assert len(list(resumed)) == 6


def test_padding_of_a_resumed_last_round_comes_from_the_epochs_first_samples():
    full = build(2, n=10, batch_size=2, shuffle=False)
    expected = [[b[0].tolist() for b in loader] for loader in full]
    loaders = build(2, n=10, batch_size=2, shuffle=False)
    _, state = run(loaders, rounds=1)
    resumed = build(2, n=10, batch_size=2, shuffle=False)
    for loader in resumed:
        loader.load_state_dict(state)
    assert [[b[0].tolist() for b in loader] for loader in resumed] == [e[1:] for e in expected]


def test_a_position_inside_a_batch_repeats_that_batch_and_says_so():
    loaders = build(1, n=20, batch_size=3, shuffle=False)
    _, state = run(loaders, rounds=1)
    resumed = build(1, n=20, batch_size=2, shuffle=False)
    resumed[0].load_state_dict(state)
    with pytest.warns(
        UserWarning,
        match=r"position \(3 samples into the epoch\) falls inside a batch .* 1 samples of it are seen twice",
    ):
        assert next(iter(resumed[0]))[0].tolist() == [2, 3]


def test_skip_first_batches_is_absolute_and_saved_as_a_position():
    loader = build(2, n=40, batch_size=2, shuffle=False)[0]
    loader.skip_batches_next_epoch(3)
    assert loader.state_dict()["samples"] == 12 and loader.state_dict()["batches_yielded"] == 3
    assert next(iter(loader))[0].tolist() == [12, 13]


def test_skip_first_batches_returns_a_view_of_the_loader_that_records_its_position():
    """The skipped loader is a DataLoaderShard sharing the prepared loader's state: a state taken while it is
    iterated holds its position, and after its epoch the prepared loader is in the next one."""
    from hasten.data_loader import DataLoaderShard, skip_first_batches

    loader = build(1, n=12, batch_size=2, shuffle=False)[0]
    view = skip_first_batches(loader, 2)
    assert isinstance(view, DataLoaderShard) and isinstance(view, DataLoader) and len(view) == 4
    assert view.batch_size == loader.batch_size and view.dataset is loader.dataset and view.sampler is loader.sampler
    seen = []
    for batch in view:
        seen.append(batch[0].tolist())
        if len(seen) == 1:
            assert loader.state_dict()["batches_yielded"] == 3 and loader.state_dict()["samples"] == 6
    assert seen == [[4, 5], [6, 7], [8, 9], [10, 11]] and loader.iteration == 1
    assert [b[0].tolist() for b in view][0] == [4, 5], "each iteration of the view skips again, as in Accelerate"


def test_ledger_counts_rounds_of_other_sizes():
    ledger = SampleLedger()
    ledger.reset(5)
    for size in (4, 4, 3, 4, 2):
        ledger.add(size)
    assert [ledger.after(k) for k in range(6)] == [5, 9, 13, 16, 20, 22]


class OwnOrder(torch.utils.data.Sampler):
    """A custom sampler drawing each epoch's order from its own generator."""

    def __init__(self, n):
        self.n, self.generator = n, torch.Generator().manual_seed(5)

    def __iter__(self):
        return iter(torch.randperm(self.n, generator=self.generator).tolist())

    def __len__(self):
        return self.n


@pytest.mark.parametrize("kind", ["custom sampler", "user generator"])
def test_an_order_drawn_from_a_generator_is_resumed_in_later_epochs(kind):
    """The epoch's order comes from the generator's state, not from seed + epoch: the state at the epoch's
    start is saved, so a resume in epoch 2 (mid-epoch, at its last batch, or after it) keeps the order."""

    def make():
        data = TensorDataset(torch.arange(12))
        if kind == "custom sampler":
            raw = DataLoader(data, batch_size=2, sampler=OwnOrder(12))
        else:
            raw = DataLoader(data, batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(4))
        return prepare_data_loader(raw, num_processes=1, process_index=0)

    reference = make()
    epochs = [[b[0].tolist() for b in reference] for _ in range(4)]
    for stop in (2, 6, "after"):
        loader = make()
        list(loader), list(loader)
        for position, _ in enumerate(loader, 1):
            if position == stop:
                state = loader.state_dict()
        if stop == "after":
            state = loader.state_dict()
        expected = {2: [epochs[2][2:], epochs[3]], 6: [[], epochs[3]], "after": [epochs[3]]}[stop]
        stateful = make()
        stateful.load_state_dict(state)
        assert [[b[0].tolist() for b in stateful] for _ in expected] == expected, stop
        default = make()
        default.restore_epoch(state)
        replayed = [b[0].tolist() for b in default]
        assert replayed == (epochs[2] if stop == 2 else epochs[3]), (stop, replayed)
