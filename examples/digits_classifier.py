"""Train a small classifier of 8x8 images of digits with hasten.

The script draws its own data, so that it needs nothing but torch and hasten: each image is one of ten
5x7 glyphs of the digits, randomly rotated, scaled, sheared and shifted, shrunk to 8x8 pixels and
blurred by noise. 1,800 of them, 1,440 to train on and 360 held out.

The script is plain PyTorch plus the four hasten lines (marked ``# hasten``). It runs unchanged on one
process (``python examples/digits_classifier.py``), on several (``hasten launch --num_processes 2
examples/digits_classifier.py``), on GPUs, and with ``--mixed_precision bf16``.
"""

import argparse

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from hasten import Accelerator  # hasten
from hasten.utils import set_seed, tqdm

GLYPHS = (  # 5x7 bitmaps of 0 to 9, one string per row
    ("01110", "10001", "10011", "10101", "11001", "10001", "01110"),
    ("00100", "01100", "00100", "00100", "00100", "00100", "01110"),
    ("01110", "10001", "00001", "00010", "00100", "01000", "11111"),
    ("11110", "00001", "00001", "01110", "00001", "00001", "11110"),
    ("00010", "00110", "01010", "10010", "11111", "00010", "00010"),
    ("11111", "10000", "11110", "00001", "00001", "10001", "01110"),
    ("00110", "01000", "10000", "11110", "10001", "10001", "01110"),
    ("11111", "00001", "00010", "00100", "01000", "01000", "01000"),
    ("01110", "10001", "10001", "01110", "10001", "10001", "01110"),
    ("01110", "10001", "10001", "01111", "00001", "00010", "01100"),
)


def draw_digits(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` distorted 8x8 digit images (flattened, values in [0, 1]) and their labels."""
    generator = torch.Generator().manual_seed(seed)
    glyphs = F.pad(torch.tensor([[[float(c) for c in row] for row in glyph] for glyph in GLYPHS]), (2, 2, 1, 1))

    def uniform(*shape):  # in [-1, 1)
        return torch.rand(*shape, generator=generator) * 2 - 1

    labels = torch.randint(0, 10, (count,), generator=generator)
    angle, scale, shear = 0.3 * uniform(count), 1 + 0.15 * uniform(count), 0.3 * uniform(count)
    shift = 0.15 * uniform(count, 2)
    cos, sin = torch.cos(angle) / scale, torch.sin(angle) / scale
    theta = torch.stack([torch.stack([cos, shear - sin, shift[:, 0]], 1), torch.stack([sin, cos, shift[:, 1]], 1)], 1)
    grid = F.affine_grid(theta, [count, 1, 16, 16], align_corners=False)
    drawn = F.grid_sample(glyphs[labels].unsqueeze(1), grid, align_corners=False)
    images = F.avg_pool2d(drawn, 2) + 0.15 * torch.randn(count, 1, 8, 8, generator=generator)
    return images.clamp(0, 1).flatten(1), labels


def datasets(seed: int):
    """1,800 drawn digits, split 80/20."""
    x, y = draw_digits(1800, seed)
    return TensorDataset(x[:1440], y[:1440]), TensorDataset(x[1440:], y[1440:])


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
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(128, 10)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True)
    test_loader = DataLoader(test_set, batch_size=64)
    model, optimizer, train_loader, test_loader = accelerator.prepare(
        model, optimizer, train_loader, test_loader
    )  # hasten
    scheduler = accelerator.prepare(
        torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(train_loader))
    )

    accelerator.print(
        f"training on {accelerator.num_processes} process(es), {accelerator.device}, mixed precision "
        f"{accelerator.mixed_precision}"
    )
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
