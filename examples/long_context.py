"""Train a small transformers Llama on long sequences split over 2 CPU processes (sequence parallelism, Ulysses).

    hasten launch --cpu --num_processes 2 --parallelism_config_sp_size 2 examples/long_context.py

Each process holds half of every 4096-byte sequence: the embeddings, MLPs, norms and the loss run on that half, and
around each attention an all-to-all gives every process the whole sequence for half of the heads (hasten's own
Ulysses under DDP, ``sp_backend="accelerate"``). The loader prepared with the model hands each process its half,
with ``position_ids`` and ``shift_labels``; the loss is Accelerate's recipe: each half's summed token loss, gathered
with its gradient over the ``sp`` group and divided by the valid tokens of the whole sequence. The same script runs
DeepSpeed's Ulysses, as Accelerate 1.12+ does (add ``--use_deepspeed --zero_stage 3``).

The model is built from a config (nothing to download) and learns the bytes of a few standard-library source files;
the held-out loss (whole sequences: the model evaluates without splitting them) falls from ln 256 = 5.5 nats per byte.
"""

import argparse
import importlib.util
import resource
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed._functional_collectives import all_gather_single_autograd
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM

from hasten import Accelerator
from hasten.utils import set_seed

CORPUS_MODULES = ("textwrap", "string", "fnmatch", "glob", "shlex", "queue", "bisect", "heapq", "argparse", "typing")


def byte_sequences(length: int) -> list[dict]:
    """Consecutive windows of ``length`` bytes of the corpus, with their positions (DeepSpeed's loader adapter needs
    them; hasten's adds them where missing) and labels (the model shifts them itself)."""
    data = b"\n\n".join(Path(importlib.util.find_spec(name).origin).read_bytes() for name in CORPUS_MODULES)
    tokens = torch.tensor(list(data), dtype=torch.long)
    windows = tokens[: len(tokens) // length * length].view(-1, length)
    positions = torch.arange(length)
    return [{"input_ids": window, "labels": window, "position_ids": positions} for window in windows]


def collate(rows: list[dict]) -> dict:
    return {key: torch.stack([row[key] for row in rows]) for key in rows[0]}


def sequence_parallel_loss(logits: torch.Tensor, shift_labels: torch.Tensor, group) -> torch.Tensor:
    """The mean next-byte loss of the whole sequences from this process's part (Accelerate's recipe): the parts'
    summed losses gathered with their gradients, over the valid tokens of all parts."""
    summed = F.cross_entropy(logits.float().flatten(0, 1), shift_labels.flatten(), ignore_index=-100, reduction="sum")
    valid = (shift_labels != -100).sum().reshape(1)
    counts = all_gather_single_autograd(valid.float(), 0, group).detach()
    return all_gather_single_autograd(summed.reshape(1), 0, group).sum() / counts.sum().clamp(min=1)


@torch.no_grad()
def held_out_loss(accelerator, model, loader) -> float:
    """Mean next-byte loss over the held-out sequences, whole (a loader prepared apart from the model is not split;
    in evaluation mode the model computes its attention as without sequence parallelism)."""
    model.eval()
    losses = [accelerator.gather_for_metrics(model(**batch).loss.reshape(1)) for batch in loader]
    model.train()
    return torch.cat(losses).mean().item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq_len", type=int, default=4096, help="bytes per sequence (a multiple of sp_size)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()
    set_seed(0)
    accelerator = Accelerator()
    config = accelerator.parallelism_config
    if config is None or not config.sp_enabled:
        parser.error("run it with --parallelism_config_sp_size 2 (see the description)")
    sequences = byte_sequences(args.seq_len)
    held_out, train = sequences[:4], sequences[4:]
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=args.seq_len,
            attn_implementation="sdpa",
        )
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    train_loader = DataLoader(train, batch_size=1, shuffle=True, collate_fn=collate)
    model, optimizer, train_loader = accelerator.prepare(model, optimizer, train_loader)
    eval_loader = accelerator.prepare(DataLoader(held_out, batch_size=1, collate_fn=collate))
    group = accelerator.torch_device_mesh["sp"].get_group()
    before = held_out_loss(accelerator, model, eval_loader)
    accelerator.print(
        f"{config.sp_size} processes split each {args.seq_len}-byte sequence ({config.sp_backend} Ulysses, "
        f"{accelerator.distributed_type}); held-out loss before training {before:.3f}"
    )
    step = 0
    while step < args.steps:
        for batch in train_loader:
            outputs = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
            loss = sequence_parallel_loss(outputs.logits, batch["shift_labels"], group)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step % 10 == 0:
                accelerator.print(
                    f"step {step}: loss {loss.item():.3f} on {batch['input_ids'].shape[1]} bytes per process"
                )
            if step == args.steps:
                break
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    accelerator.print(f"held-out loss after {step} steps {held_out_loss(accelerator, model, eval_loader):.3f}")
    print(f"process {accelerator.process_index}: peak memory {peak:.0f} MB", flush=True)
    accelerator.end_training()


if __name__ == "__main__":
    main()
