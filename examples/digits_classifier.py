"""Train a small classifier on scikit-learn's bundled handwritten digits with hasten.

The script is plain PyTorch plus the four hasten lines (marked ``# hasten``). It runs unchanged on one
process (``python examples/digits_classifier.py``), on several (``hasten launch --num_processes 2
examples/digits_classifier.py``), on GPUs, and with ``--mixed_precision bf16``.
"""

import argparse

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset

from hasten import Accelerator  # hasten
from hasten.utils import set_seed, tqdm


def datasets(seed: int):
    """The 1,797 digits (8x8 images, 10 classes), split 80/20 with a fixed permutation."""
    images, labels = load_digits(return_X_y=True)
    x = torch.tensor(images, dtype=torch.float32) / 16.0
    y = torch.tensor(labels, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(x))
    train, test = order[:cut], order[cut:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


def evaluate(accelerator, model, loader) -> tuple[float, int]:
    """Accuracy over the whole test set (gathered from every process) and the number of samples."""
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for inputs, targets in loader:
            predictions = model(inputs).argmax(dim=-1)
            predictions, targets = accelerator.gather_for_metrics((predictions, targets))
            correct += (predictions == targets).sum().item()
            total += targets.numel()
    return correct / total, total


def main() -> None:
    """Train for ``--epochs`` epochs, evaluating after each."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch_size", type=int, default=32, help="per process")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--mixed_precision", default=None, choices=["no", "fp16", "bf16"])
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()

    accelerator = Accelerator(mixed_precision=args.mixed_precision)  # hasten
    set_seed(args.seed)
    train_set, test_set = datasets(args.seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(128, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True)
    test_loader = DataLoader(test_set, batch_size=64)
    model, optimizer, train_loader, test_loader = accelerator.prepare(model, optimizer, train_loader, test_loader)  # hasten
    scheduler = accelerator.prepare(torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(train_loader)))

    accelerator.print(f"training on {accelerator.num_processes} process(es), {accelerator.device}, mixed precision {accelerator.mixed_precision}")
    for epoch in range(args.epochs):
        model.train()
        for inputs, targets in tqdm(train_loader, desc=f"epoch {epoch}", leave=False):
            loss = F.cross_entropy(model(inputs), targets)
            accelerator.backward(loss)  # hasten
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        accuracy, total = evaluate(accelerator, model, test_loader)
        accelerator.print(f"epoch {epoch}: test accuracy {accuracy:.4f} on {total} samples")
    accelerator.end_training()


if __name__ == "__main__":
    main()
