"""Gradient synchronisation on every process of a job: ``no_sync``, ``accumulate`` and the dataloader bookkeeping
they rely on, checked against what each process can compute itself: ``debug_launcher(test_sync.main)`` (Accelerate's
own test suite runs it so, on 1 and 2 processes) or ``hasten launch test_sync.py``. A failed check raises
``AssertionError`` naming the step and the gradients.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils.data import DataLoader

from hasten.accelerator import Accelerator
from hasten.runtime.operations import gather
from hasten.state import GradientState, PartialState, reset_state
from hasten.test_utils.training import RegressionDataset, RegressionModel


def _gradients(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.detach().flatten() for p in model.parameters()])


def _agree(model: torch.nn.Module) -> bool:
    """Whether every process holds the same gradients."""
    everyone = gather(_gradients(model)[None])
    return bool((everyone == everyone[0]).all())


def _batch(step: int, rank: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch only this process sees (so unsynchronised gradients differ between processes)."""
    x = torch.arange(4.0, device=device) + 10 * step + 100 * rank
    return x, 2 * x + 3


def check_no_sync() -> None:
    """Inside ``no_sync`` each process keeps its own gradients; the next backward outside it averages them all."""
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(RegressionModel())
    multi, rank = accelerator.num_processes > 1, accelerator.process_index
    for step in range(4):
        x, y = _batch(step, rank, accelerator.device)
        inside = step % 2 == 0
        with accelerator.no_sync(model) if inside else contextlib.nullcontext():
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        agree = _agree(model)
        assert agree == (not inside or not multi), (
            f"step {step}: gradients {'agree' if agree else 'differ'} across processes"
        )
        if not inside:
            model.zero_grad()


def check_accumulate(steps: int = 2) -> None:
    """``accumulate`` synchronises (and lets the optimizer step) on every ``steps``-th batch and on the last one."""
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=steps)
    model = RegressionModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(RegressionDataset(length=7 * accelerator.num_processes * 2), batch_size=2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for index, batch in enumerate(loader):
        with accelerator.accumulate(model):
            accelerator.backward(torch.nn.functional.mse_loss(model(batch["x"]), batch["y"]))
            expected = (index + 1) % steps == 0 or index == len(loader) - 1
            assert accelerator.sync_gradients == expected, (
                f"batch {index}: sync_gradients is {accelerator.sync_gradients}"
            )
            if expected and accelerator.num_processes > 1:
                assert _agree(model), f"batch {index}: gradients differ across processes on a synchronising step"
            optimizer.step()
            optimizer.zero_grad()


def check_dataloader_break() -> None:
    """Leaving a loop early leaves no loader active; a finished loop reaches its end on its last batch."""
    accelerator = Accelerator(cpu=True)
    first, second = (
        accelerator.prepare(DataLoader(RegressionDataset(length=8 * accelerator.num_processes), batch_size=2))
        for _ in range(2)
    )
    for index, _ in enumerate(first):
        assert GradientState().active_dataloader is first, f"batch {index}: the active loader is not the one iterated"
        if index == 1:
            for inner, _ in enumerate(second):
                assert GradientState().end_of_dataloader == (inner == len(second) - 1), (
                    f"inner batch {inner}: end_of_dataloader"
                )
            assert GradientState().active_dataloader is first, "after the inner loop the outer loader is active again"
            break
    assert GradientState().active_dataloader is None, "a loop left with break still has an active loader"


def main() -> None:
    """Run every check on this process, each with a fresh Accelerator."""
    for check in (check_no_sync, check_accumulate, check_dataloader_break):
        reset_state()
        check()
        PartialState().print(f"  {check.__name__.removeprefix('check_')}: ok")


if __name__ == "__main__":
    main()
