"""Stop training when the validation loss stops improving, on every process at the same step.

Each process measures the validation loss on its own shard of the validation set (as when every
machine validates on its own data, or when gathering is too expensive to do often), so the processes
disagree on when to stop. A process that simply left its loop would leave the others waiting for it
in the next gradient all-reduce until the job timed out. Instead, a process whose patience ran out
calls ``accelerator.set_trigger()``, and every process calls ``accelerator.check_trigger()`` at the
same point of the loop: it returns True everywhere as soon as any process set the trigger.

The model (a wide MLP on 128 noisy samples) overfits quickly, so
``hasten launch --num_processes 2 examples/early_stopping.py`` stops long before ``--max_steps``.
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hasten import Accelerator
from hasten.utils import set_seed


def datasets(seed: int, features: int = 8):
    """A noisy non-linear regression: 128 training samples, 64 for validation."""
    generator = torch.Generator().manual_seed(seed)
    direction = torch.randn(features, generator=generator)
    x = torch.randn(192, features, generator=generator)
    y = torch.sin(x @ direction).unsqueeze(1) + 0.3 * torch.randn(192, 1, generator=generator)
    return TensorDataset(x[:128], y[:128]), TensorDataset(x[128:], y[128:])


class Patience:
    """Counts evaluations without an improvement of at least ``min_delta``."""

    def __init__(self, patience: int, min_delta: float):
        self.patience, self.min_delta = patience, min_delta
        self.best, self.best_step, self.bad_evaluations = float("inf"), 0, 0

    def exhausted(self, loss: float, step: int) -> bool:
        """Record the loss of an evaluation; True once ``patience`` evaluations in a row did not improve."""
        if loss < self.best - self.min_delta:
            self.best, self.best_step, self.bad_evaluations = loss, step, 0
        else:
            self.bad_evaluations += 1
        return self.bad_evaluations >= self.patience


def validation_loss(accelerator, model, loader, gather: bool) -> float:
    """Mean squared error on this process's shard, or on the whole validation set with ``gather``."""
    model.eval()
    errors = []
    with torch.no_grad():
        for inputs, targets in loader:
            error = (model(inputs) - targets).pow(2).flatten()
            errors.append(accelerator.gather_for_metrics(error) if gather else error)
    model.train()
    return torch.cat(errors).mean().item()


def main() -> None:
    """Train until every process agrees to stop, then report the validation loss."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max_steps", type=int, default=400)
    parser.add_argument("--eval_every", type=int, default=4, help="optimizer steps between evaluations")
    parser.add_argument("--patience", type=int, default=3, help="evaluations without improvement before stopping")
    parser.add_argument("--min_delta", type=float, default=1e-3)
    parser.add_argument("--batch_size", type=int, default=16, help="per process")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    accelerator = Accelerator()
    set_seed(args.seed)
    train_set, valid_set = datasets(args.seed)
    model = nn.Sequential(nn.Linear(8, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True)
    valid_loader = DataLoader(valid_set, batch_size=16)
    model, optimizer, train_loader, valid_loader = accelerator.prepare(model, optimizer, train_loader, valid_loader)

    rank = accelerator.process_index
    patience = Patience(args.patience, args.min_delta)
    step = 0
    stopped = False
    while step < args.max_steps and not stopped:
        for inputs, targets in train_loader:
            loss = F.mse_loss(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step % args.eval_every != 0:
                continue
            local_loss = validation_loss(accelerator, model, valid_loader, gather=False)
            if patience.exhausted(local_loss, step):
                print(
                    f"rank {rank}: step {step}: patience ran out (validation loss {local_loss:.4f}, best "
                    f"{patience.best:.4f} "
                    f"at step {patience.best_step}); asking every process to stop",
                    flush=True,
                )
                accelerator.set_trigger()
            if accelerator.check_trigger():  # on every process, at the same point of the loop
                stopped = True
                break
            if step >= args.max_steps:
                break

    full_loss = validation_loss(accelerator, model, valid_loader, gather=True)
    print(f"rank {rank}: stopped at step {step} of {args.max_steps}", flush=True)
    accelerator.print(f"validation loss on all {len(valid_set)} samples: {full_loss:.4f}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
