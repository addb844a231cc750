"""Train a small transformers LlamaForCausalLM with FSDP x tensor parallelism on 4 CPU processes.

    hasten launch --cpu --num_processes 4 examples/tp_fsdp_llama.py

lays the 4 processes out as ``ParallelismConfig(tp_size=2)`` with the data-parallel shard size filling the
rest (dp_shard=2): each layer's attention and MLP projections are split between 2 tensor-parallel peers
(the plan transformers ships with the model: ``config.base_model_tp_plan``), then FSDP2 shards every
parameter between the 2 data-parallel ranks, which read different batches. Each process holds about a
quarter of the parameters (printed). The same layout from the launch command instead of the script:
``--parallelism_config_dp_shard_size 2 --parallelism_config_tp_size 2``.

The model is built from a config (nothing to download) and learns the bytes of a few standard-library
source files (a byte-level model, 256 tokens); the held-out loss falls from ln 256 = 5.5 nats per byte.
"""

import argparse
import importlib.util
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset
from transformers import LlamaConfig, LlamaForCausalLM

from hasten import Accelerator, ParallelismConfig
from hasten.utils import set_seed

CORPUS_MODULES = ("textwrap", "string", "fnmatch", "glob", "shlex", "queue", "bisect", "heapq")

# torch's FSDP2 warns at the first forward that the model returned a view: the logits of the tensor-parallel lm_head
# are one (DTensor.to_local returns a view of the gathered tensor), and an in-place op on them (`logits /= t`) would
# skip FSDP's pre-backward hook. This script never changes them in place, so the warning says nothing about it.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(.*\) returned a view tensor", category=UserWarning)


def byte_windows(block_size: int) -> TensorDataset:
    """Consecutive windows of ``block_size`` bytes of the corpus, with their next-byte targets."""
    data = b"\n\n".join(Path(importlib.util.find_spec(name).origin).read_bytes() for name in CORPUS_MODULES)
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    count = (len(tokens) - 1) // block_size
    inputs = tokens[: count * block_size].view(count, block_size)
    targets = tokens[1 : count * block_size + 1].view(count, block_size)
    return TensorDataset(inputs, targets)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tp_size", type=int, default=None, help="tensor-parallel size (default: the launch setting, else 2)"
    )
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch_size", type=int, default=8, help="sequences per data-parallel rank and step")
    parser.add_argument("--block_size", type=int, default=64)
    args = parser.parse_args()

    config = ParallelismConfig(tp_size=args.tp_size)
    if args.tp_size is None and config.tp_size == 1:
        config = ParallelismConfig(tp_size=2)
    accelerator = Accelerator(parallelism_config=config)
    set_seed(0)
    model_config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=args.block_size,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(model_config)
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    data = byte_windows(args.block_size)
    held_out = len(data) // 10
    train_set = torch.utils.data.Subset(data, range(held_out, len(data)))
    eval_set = torch.utils.data.Subset(data, range(held_out))
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True)
    eval_loader = DataLoader(eval_set, batch_size=args.batch_size)
    model, train_loader, eval_loader = accelerator.prepare(model, train_loader, eval_loader)
    optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=3e-3))

    mesh = accelerator.torch_device_mesh
    mine = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in model.parameters())
    accelerator.print(f"mesh {dict(zip(mesh.mesh_dim_names, mesh.shape))}")
    print(
        f"rank {accelerator.process_index} (data-parallel rank {accelerator.data_parallel_rank}, tensor-parallel rank "
        f"{accelerator.tensor_parallel_rank}) holds {mine / full_bytes:.3f} of the parameter bytes"
    )

    def loss_of(inputs, targets):
        return F.cross_entropy(model(input_ids=inputs).logits.reshape(-1, 256), targets.reshape(-1))

    def evaluate() -> float:
        model.eval()
        with torch.no_grad():
            losses = [accelerator.reduce(loss_of(x, y), "mean") for x, y in eval_loader]
        model.train()
        return torch.stack(losses).mean().item()

    accelerator.print(f"held-out loss before training {evaluate():.3f}")
    step = 0
    while step < args.steps:
        for inputs, targets in train_loader:
            loss = loss_of(inputs, targets)
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step % 20 == 0:
                accelerator.print(f"step {step}: training loss {accelerator.reduce(loss.detach(), 'mean').item():.3f}")
            if step == args.steps:
                break
    accelerator.print(f"held-out loss after {step} steps {evaluate():.3f}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
