"""A prepared loader draws from the random streams what Accelerate draws there and nothing more; a resumed epoch
replays how it started instead of drawing again (tests/compat/test_differential_loop.py compares with Accelerate)."""

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from hasten import Accelerator
from hasten.data_loader import prepare_data_loader
from hasten.utils import set_seed


def test_one_process_prepare_draws_nothing_and_shuffles_as_a_plain_loader():
    """Before, prepare drew a seed from the global generator for every map-style loader: every later draw moved."""
    torch.manual_seed(3)
    expected = (
        [b.tolist() for _ in range(2) for b in DataLoader(list(range(20)), batch_size=4, shuffle=True)],
        torch.rand(3),
    )
    torch.manual_seed(3)
    before = torch.get_rng_state()
    loader = prepare_data_loader(DataLoader(list(range(20)), batch_size=4, shuffle=True))
    assert torch.get_rng_state().equal(before), "prepare drew from the global generator"
    got = [b.tolist() for _ in range(2) for b in loader], torch.rand(3)
    assert got[0] == expected[0] and got[1].equal(expected[1])


def test_several_processes_seed_the_sampler_with_one_draw_shared_per_epoch():
    set_seed(5)
    loaders = []
    for rank in range(2):  # both simulated ranks start from the same global state, as set_seed gives them
        set_seed(5)
        loaders.append(
            prepare_data_loader(
                DataLoader(list(range(12)), batch_size=3, shuffle=True), num_processes=2, process_index=rank
            )
        )
        after = torch.get_rng_state()
    set_seed(5)
    torch.empty((), dtype=torch.int64).random_()
    assert torch.get_rng_state().equal(after), "prepare draws exactly one number for the sampler's generator"
    epochs = [[sorted(i for loader in loaders for b in loader for i in b.tolist())] for _ in range(2)]
    assert epochs == [[list(range(12))]] * 2, "the ranks shuffle alike, so together they cover the data once per epoch"


class _WorkerSeeds(Dataset):
    """Each sample is the seed of the worker that loaded it (the DataLoader iterator's base seed + worker id)."""

    def __len__(self):
        return 8

    def __getitem__(self, index):
        return torch.tensor([index, torch.utils.data.get_worker_info().seed])


def _run(
    folder, save_after: int, resume: tuple[int, int] | None = None, workers: int = 0, loader_generator: bool = False
):
    """Train two epochs (dropout, shuffling) on one process and save after ``save_after`` batches; or, with
    ``resume=(epoch, batches)``, load ``folder`` and go on from there, skipping what the checkpoint trained."""
    accelerator = Accelerator()
    set_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if workers:
        data = _WorkerSeeds()
    else:
        data = TensorDataset(torch.arange(12), torch.randn(12, 2, generator=torch.Generator().manual_seed(1)))
    generator = torch.Generator().manual_seed(5) if loader_generator else None
    loader = DataLoader(data, batch_size=2, shuffle=True, num_workers=workers, generator=generator)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    seen = []
    if resume:
        accelerator.load_state(folder)
    first_epoch, skip = resume or (0, 0)
    for epoch in range(first_epoch, 2):
        active = accelerator.skip_first_batches(loader, skip) if resume and epoch == first_epoch else loader
        for step, batch in enumerate(active):
            features = batch.float() if workers else batch[1]
            seen.append((batch if workers else batch[0]).tolist())
            accelerator.backward(model(features).pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()
            if not resume and epoch * len(loader) + step + 1 == save_after:
                accelerator.save_state(folder)
    return seen, [p.detach().clone() for p in model.parameters()], torch.rand(2)


@pytest.mark.parametrize("loader_generator", [False, True])
@pytest.mark.parametrize("save_after, resume", [(3, (0, 3)), (6, (1, 0))])
def test_a_resumed_run_is_the_uninterrupted_one_bit_for_bit(tmp_path, save_after, resume, loader_generator):
    """In the middle of an epoch the checkpoint holds the states the epoch started from: the resumed run sees the
    same batches and draws the same dropout masks (Accelerate draws the epoch's seeds again: see ALLOWED). At the
    end of an epoch it holds where the loader's own generator (here, with ``loader_generator``, the shuffling one)
    stands, so the next epochs shuffle as the uninterrupted run's."""
    seen, weights, probe = _run(tmp_path / "ckpt", save_after, loader_generator=loader_generator)
    resumed_seen, resumed_weights, resumed_probe = _run(
        tmp_path / "ckpt", save_after, resume, loader_generator=loader_generator
    )
    assert resumed_seen == seen[save_after:]
    assert all(a.equal(b) for a, b in zip(weights, resumed_weights)) and probe.equal(resumed_probe)


@pytest.mark.slow
def test_a_resumed_epoch_gives_workers_the_same_seeds(tmp_path):
    seen, _, probe = _run(tmp_path / "ckpt", 2, workers=1)
    resumed_seen, _, resumed_probe = _run(tmp_path / "ckpt", 2, (0, 2), workers=1)
    assert resumed_seen == seen[2:], "the order and the workers' seeds of the resumed epoch"
    assert probe.equal(resumed_probe)
