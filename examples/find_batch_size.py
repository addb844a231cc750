"""Start with a large batch size and let ``find_executable_batch_size`` shrink it until the run fits.

Everything that depends on the batch size (the dataloaders) or takes device memory (the model and
the optimizer) is built inside the decorated function, which starts with ``accelerator.free_memory()``
so that a retry begins from scratch. On a GPU the out-of-memory error is real; on a CPU there is
rarely one to see, so the model here simulates it: its forward raises the error PyTorch raises
(``torch.OutOfMemoryError``) when a batch holds more than ``--oom_above`` samples.

By default each out-of-memory error multiplies the batch size by 0.9 (as Accelerate 1.15 does); this
example halves it instead, with ``reduce_batch_size_fn`` (called with no argument, it returns the next
size). ``hasten launch --num_processes 2 examples/find_batch_size.py`` tries 256, 128, 64 and 32 samples
per process, runs out of (simulated) memory at each, and trains at 16. All processes agree on every
attempt, so they always train with the same batch size.
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hasten import Accelerator
from hasten.utils import find_executable_batch_size, set_seed


class SimulatedMemoryMLP(nn.Module):
    """A classifier whose forward raises ``torch.OutOfMemoryError`` for batches larger than ``oom_above``."""

    def __init__(self, features: int, classes: int, oom_above: int):
        super().__init__()
        self.oom_above = oom_above
        self.layers = nn.Sequential(nn.Linear(features, 128), nn.ReLU(), nn.Linear(128, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.oom_above:
            raise torch.OutOfMemoryError(
                f"CPU out of memory (simulated): a batch of {x.shape[0]} samples does not fit, at most "
                f"{self.oom_above} do."
            )
        return self.layers(x)


def datasets(seed: int, features: int = 32, classes: int = 4):
    """Points labelled by a random linear teacher: 2,048 for training, 500 held out."""
    generator = torch.Generator().manual_seed(seed)
    teacher = torch.randn(features, classes, generator=generator)
    x = torch.randn(2548, features, generator=generator)
    y = (x @ teacher).argmax(dim=1)
    return TensorDataset(x[:2048], y[:2048]), TensorDataset(x[2048:], y[2048:])


def main() -> None:
    """Train at the largest batch size that fits and report it."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch_size", type=int, default=256, help="first batch size tried, per process")
    parser.add_argument("--oom_above", type=int, default=20, help="simulated memory: the largest batch that fits")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    accelerator = Accelerator()
    train_set, eval_set = datasets(args.seed)

    tried = [args.batch_size]

    def halve() -> int:
        """The next batch size to try after an out-of-memory error: half of the last one."""
        tried.append(tried[-1] // 2)
        return tried[-1]

    @find_executable_batch_size(starting_batch_size=args.batch_size, reduce_batch_size_fn=halve)
    def inner_training_loop(batch_size: int):
        """One complete attempt at ``batch_size``: build, prepare, train, evaluate."""
        accelerator.free_memory()  # drop what the failed attempt left behind
        accelerator.print(f"trying batch size {batch_size} per process")
        set_seed(args.seed)
        model = SimulatedMemoryMLP(32, 4, args.oom_above)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        train_loader = DataLoader(train_set, batch_size=batch_size, shuffle=True)
        eval_loader = DataLoader(eval_set, batch_size=batch_size)
        model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)
        for _ in range(args.epochs):
            for inputs, targets in train_loader:
                loss = F.cross_entropy(model(inputs), targets)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
        correct = total = 0
        model.eval()
        with torch.no_grad():
            for inputs, targets in eval_loader:
                predictions, targets = accelerator.gather_for_metrics((model(inputs).argmax(dim=1), targets))
                correct += (predictions == targets).sum().item()
                total += len(targets)
        return batch_size, correct / total

    batch_size, accuracy = inner_training_loop()  # called without the batch size: the decorator passes it
    accelerator.print(
        f"trained with batch size {batch_size} per process: accuracy {accuracy:.4f} on {len(eval_set)} held-out samples"
    )
    accelerator.end_training()


if __name__ == "__main__":
    main()
