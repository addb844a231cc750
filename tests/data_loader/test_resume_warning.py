"""After ``load_state`` of a checkpoint saved mid-epoch, a prepared loader (not stateful) restarts the epoch at its
first batch: the first such iteration says so once, with the two ways to continue where the save was. Resuming with
``skip_first_batches``, with a stateful loader, or from a save at an epoch's end says nothing."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from hasten import Accelerator, DataLoaderConfiguration

BATCHES = 8


def _run(tmp_path, save_after: int, stateful: bool = False, dispatch: bool = False):
    """Train until ``save_after`` batches of epoch 0 were handed out, save, load; returns the accelerator and loader."""
    config = DataLoaderConfiguration(use_stateful_dataloader=stateful, dispatch_batches=dispatch or None)
    accelerator = Accelerator(dataloader_config=config)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.arange(4.0 * BATCHES).view(2 * BATCHES, 2))
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=2, shuffle=True))
    for step, (inputs,) in enumerate(loader):
        accelerator.backward(model(inputs).sum())
        optimizer.step()
        if step + 1 == save_after:
            accelerator.save_state(tmp_path / "ckpt")
            break
    if save_after == BATCHES:
        accelerator.save_state(tmp_path / "ckpt")  # after the loop left the epoch
    accelerator.load_state(tmp_path / "ckpt")
    return accelerator, loader


def _batches(loader) -> tuple[int, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        count = sum(1 for _ in loader)
    return count, [str(w.message) for w in caught if "starts epoch" in str(w.message)]


@pytest.mark.parametrize("dispatch", [False, True])
def test_restarting_a_recorded_epoch_warns_once_with_the_fix(tmp_path, dispatch):
    accelerator, loader = _run(tmp_path, save_after=3, dispatch=dispatch)
    count, messages = _batches(loader)
    assert count == BATCHES  # the default: the epoch again, from its first batch
    assert messages == [
        "A prepared dataloader starts epoch 0 at its first batch, but the checkpoint load_state restored was saved "
        "after batch 3 of that epoch: the loop trains on those batches again. To continue after them, iterate "
        "accelerator.skip_first_batches(loader, 3) for this epoch (then the loader itself), or prepare with "
        "DataLoaderConfiguration(use_stateful_dataloader=True), with which load_state restores the position. A loop "
        "that skips them itself (`if step < resume_step: continue`) can use skip_first_batches instead, which does "
        "not load them."
    ]
    assert _batches(loader) == (BATCHES, [])  # the next epoch: nothing to say


def test_the_warning_points_at_the_loop(tmp_path):
    _, loader = _run(tmp_path, save_after=3)
    with pytest.warns(UserWarning, match="starts epoch 0 at its first batch") as caught:
        for _ in loader:
            pass
    assert caught[0].filename == __file__


def test_resuming_exactly_says_nothing(tmp_path):
    accelerator, loader = _run(tmp_path / "skip", save_after=3)
    assert _batches(accelerator.skip_first_batches(loader, 3)) == (BATCHES - 3, [])
    _, loader = _run(tmp_path / "stateful", save_after=3, stateful=True)
    assert _batches(loader) == (BATCHES - 3, [])
    _, loader = _run(tmp_path / "end", save_after=BATCHES)
    assert _batches(loader) == (BATCHES, [])
    _, loader = _run(tmp_path / "moved_on", save_after=3)
    loader.set_epoch(1)  # the loop went on to the next epoch
    assert _batches(loader) == (BATCHES, [])
