"""Train a small GPT-style language model from scratch on Python's own standard-library source code.

The corpus is the source of a fixed list of standard-library modules, read as bytes (a byte-level
model: 256 tokens, no tokenizer, nothing to download). The last 10% of the bytes are held out to
measure perplexity. The script shows the pieces a real training run needs:

- gradient accumulation (``--gradient_accumulation_steps`` with ``accelerator.accumulate``),
- gradient clipping (``accelerator.clip_grad_norm_``) and mixed precision (``--mixed_precision bf16``),
- held-out perplexity with ``accelerator.gather_for_metrics`` (exactly the held-out sequences, no duplicates),
- checkpoints with automatic names (``ProjectConfiguration``), resumed with ``--resume`` (the latest
  one) or ``--resume PATH``: the run continues at the step and batch it stopped at, with the
  optimizer, learning-rate schedule and random states restored,
- TensorBoard logging (``log_with="tensorboard"``; ``tensorboard --logdir <output_dir>``),
- one progress bar per machine (``hasten.utils.tqdm``).

With the defaults, ``hasten launch --num_processes 2 examples/language_model.py`` trains for 100
optimizer steps (10 to 20 seconds on two CPU cores) and reaches a held-out loss below 2.75 nats per
byte (perplexity below 16; it measures 2.63). A model that knows nothing scores ln 256 = 5.5, one that
knows only how frequent each byte is 3.2. Then
``hasten launch --num_processes 2 examples/language_model.py --resume --max_steps 150`` continues
from the last checkpoint for 50 more steps.
"""

import argparse
import importlib.util
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from hasten import Accelerator, DataLoaderConfiguration
from hasten.utils import ProjectConfiguration, set_seed, tqdm

CORPUS_MODULES = (
    "textwrap",
    "string",
    "fnmatch",
    "glob",
    "shlex",
    "queue",
    "bisect",
    "heapq",
    "colorsys",
    "contextlib",
    "calendar",
    "pprint",
    "functools",
    "dataclasses",
)


def load_corpus(max_bytes: int) -> torch.Tensor:
    """The first ``max_bytes`` bytes of the concatenated source files of ``CORPUS_MODULES``, as token ids."""
    parts = [Path(importlib.util.find_spec(name).origin).read_bytes() for name in CORPUS_MODULES]
    data = b"\n\n".join(parts)[:max_bytes]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


class Chunks(Dataset):
    """Consecutive, non-overlapping windows of ``block_size`` tokens with their next-token targets."""

    def __init__(self, tokens: torch.Tensor, block_size: int):
        self.tokens, self.block_size = tokens, block_size

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.block_size

    def __getitem__(self, index: int):
        start = index * self.block_size
        window = self.tokens[start : start + self.block_size + 1]
        return window[:-1], window[1:]


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention, then an MLP, each with a residual connection."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, length, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, dim))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """A decoder-only transformer over bytes; the output layer shares the token embedding's weights."""

    def __init__(self, block_size: int, layers: int, heads: int, dim: int, vocab_size: int = 256):
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, dim)
        self.positions = nn.Parameter(torch.zeros(block_size, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        nn.init.normal_(self.tokens.weight, std=0.02)
        nn.init.normal_(self.positions, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tokens(ids) + self.positions[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class TrainingProgress:
    """The loop counter saved in every checkpoint (``register_for_checkpointing``)."""

    def __init__(self):
        self.step = 0

    def state_dict(self) -> dict:
        """The counter, for ``save_state``."""
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        """Restore the counter, in ``load_state``."""
        self.step = state["step"]


def warmup_then_cosine(warmup: int, total: int):
    """Learning-rate multiplier: linear warm-up, then cosine decay to 10%."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min((step - warmup) / max(total - warmup, 1), 1.0)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))

    return factor


def evaluate(accelerator, model, loader) -> tuple[float, int]:
    """Mean held-out loss per byte over every held-out sequence, and the number of sequences."""
    model.eval()
    losses = []
    with torch.no_grad():
        for inputs, targets in tqdm(loader, desc="evaluating", leave=False):
            logits = model(inputs).float()
            per_sequence = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none").mean(dim=1)
            losses.append(accelerator.gather_for_metrics(per_sequence))
    model.train()
    losses = torch.cat(losses)
    return losses.mean().item(), len(losses)


def parse_args() -> argparse.Namespace:
    """The command line of the example."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default="runs/language_model", help="checkpoints and TensorBoard logs")
    parser.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        default=None,
        help="resume from the latest checkpoint of --output_dir, or from the given checkpoint folder",
    )
    parser.add_argument("--max_steps", type=int, default=100, help="optimizer steps")
    parser.add_argument("--batch_size", type=int, default=16, help="sequences per process and micro-batch")
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
    parser.add_argument("--block_size", type=int, default=64, help="bytes per sequence")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--warmup_steps", type=int, default=20)
    parser.add_argument("--max_grad_norm", type=float, default=1.0)
    parser.add_argument("--mixed_precision", default=None, choices=["no", "fp16", "bf16"])
    parser.add_argument("--corpus_bytes", type=int, default=160_000)
    parser.add_argument("--log_every", type=int, default=10)
    parser.add_argument("--eval_every", type=int, default=50)
    parser.add_argument("--checkpoint_every", type=int, default=50)
    parser.add_argument("--keep_checkpoints", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def main() -> None:
    """Build, prepare (and resume), train, evaluate."""
    args = parse_args()
    project = ProjectConfiguration(
        project_dir=args.output_dir, automatic_checkpoint_naming=True, total_limit=args.keep_checkpoints
    )
    accelerator = Accelerator(
        mixed_precision=args.mixed_precision,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        log_with="tensorboard",
        project_config=project,
        dataloader_config=DataLoaderConfiguration(
            use_stateful_dataloader=True
        ),  # load_state restores the loader's position
    )
    set_seed(args.seed)

    tokens = load_corpus(args.corpus_bytes)
    cut = int(0.9 * len(tokens))
    train_loader = DataLoader(
        Chunks(tokens[:cut], args.block_size), batch_size=args.batch_size, shuffle=True, drop_last=True
    )
    eval_loader = DataLoader(Chunks(tokens[cut:], args.block_size), batch_size=4 * args.batch_size)
    model = GPT(args.block_size, args.layers, args.heads, args.dim)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.01)
    # A prepared scheduler steps once per process for each optimizer step, so its schedule counts them all.
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        warmup_then_cosine(args.warmup_steps * accelerator.num_processes, args.max_steps * accelerator.num_processes),
    )
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler
    )

    progress = TrainingProgress()
    accelerator.register_for_checkpointing(progress)
    if args.resume is not None:
        path = accelerator.load_state(None if args.resume == "latest" else args.resume)
        accelerator.print(f"resumed from {path} at step {progress.step}")
    accelerator.init_trackers("language_model", config=vars(args))
    accelerator.print(
        f"{len(tokens):,} bytes of corpus, {sum(p.numel() for p in model.parameters()):,} parameters, "
        f"{accelerator.num_processes} process(es)"
    )

    train(args, accelerator, model, optimizer, scheduler, train_loader, eval_loader, progress)
    loss, count = evaluate(accelerator, model, eval_loader)
    accelerator.print(
        f"step {progress.step}: held-out loss {loss:.4f} (perplexity {math.exp(loss):.2f}) on {count} sequences"
    )
    accelerator.log({"eval/loss": loss, "eval/perplexity": math.exp(loss)}, step=progress.step)
    accelerator.end_training()


def train(args, accelerator, model, optimizer, scheduler, train_loader, eval_loader, progress) -> None:
    """Train until ``progress.step`` reaches ``--max_steps``, logging, evaluating and saving on the way."""
    bar = tqdm(total=args.max_steps, initial=progress.step, desc="training")
    running_loss, micro_batches = torch.zeros((), device=accelerator.device), 0
    while progress.step < args.max_steps:
        for inputs, targets in train_loader:  # after load_state, the first epoch continues mid-way
            with accelerator.accumulate(model):
                logits = model(inputs)
                loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            running_loss += loss.detach()
            micro_batches += 1
            if not accelerator.sync_gradients:
                continue
            progress.step += 1
            bar.update(1)
            if progress.step % args.log_every == 0:
                mean_loss = accelerator.reduce(running_loss / micro_batches, reduction="mean").item()
                accelerator.print(f"step {progress.step}: loss {mean_loss:.4f}")
                accelerator.log({"train/loss": mean_loss, "train/lr": scheduler.get_last_lr()[0]}, step=progress.step)
                running_loss.zero_()
                micro_batches = 0
            if progress.step % args.eval_every == 0 and progress.step < args.max_steps:
                loss_value, count = evaluate(accelerator, model, eval_loader)
                accelerator.print(
                    f"step {progress.step}: held-out loss {loss_value:.4f} (perplexity {math.exp(loss_value):.2f}) "
                    f"on {count} sequences"
                )
                accelerator.log({"eval/loss": loss_value, "eval/perplexity": math.exp(loss_value)}, step=progress.step)
            if progress.step % args.checkpoint_every == 0 or progress.step == args.max_steps:
                accelerator.print(f"step {progress.step}: saved {accelerator.save_state()}")
            if progress.step >= args.max_steps:
                break
    bar.close()


if __name__ == "__main__":
    main()
