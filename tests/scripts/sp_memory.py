"""Memory per process of one training step on a long sequence, with and without sequence parallelism:
``sp_memory.py SEQ``, on 1 process (no sequence parallelism) or under torchrun on ``sp`` processes
(``ParallelismConfig(sp_size=world)``: hasten's Ulysses under DDP).

A small transformers Llama (hidden 128, 4 layers, 4 query and 2 key/value heads, vocabulary 512) takes one step on one
sequence of SEQ tokens. Measured on each process: the bytes autograd keeps for the backward (every tensor saved during
the forward, parameters excluded: the activations) and the growth of the process's peak resident memory over the
step (``ru_maxrss``: activations, gradients, the attention's work space, allocator slack; one length per process, as
the peak never comes down). Rank 0 prints ``MEMORY seq=... sp=... saved_mb=... peak_rss_growth_mb=...`` (the largest
of the ranks).
"""

import os
import resource
import sys

import torch
import torch.distributed as dist

from hasten import Accelerator, ParallelismConfig

VOCAB = 512


def model_for(seq: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=seq,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def saved_bytes(parameters):
    """A saved-tensors hook pair that adds up the bytes of the non-parameter tensors autograd keeps."""
    storages = {p.untyped_storage().data_ptr() for p in parameters}
    total = [0]

    def pack(tensor):
        if tensor.untyped_storage().data_ptr() not in storages:
            total[0] += tensor.numel() * tensor.element_size()
        return tensor

    return total, pack, lambda tensor: tensor


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def step(accelerator, seq: int, split: int) -> tuple[float, float]:
    model = model_for(seq)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(1))
    row = {"input_ids": ids[0], "labels": ids[0], "position_ids": torch.arange(seq)}
    loader = torch.utils.data.DataLoader([row], batch_size=1)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    batch = next(iter(loader))
    total, pack, unpack = saved_bytes(list(model.parameters()))
    before = peak_rss_mb()
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        labels = batch["shift_labels"] if split > 1 else torch.nn.functional.pad(ids, (0, 1), value=-100)[:, 1:]
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1))
    accelerator.backward(loss)
    optimizer.step()
    return total[0] / 2**20, peak_rss_mb() - before


def main():
    world, seq = int(os.environ.get("WORLD_SIZE", "1")), int(sys.argv[1])
    config = ParallelismConfig(sp_size=world) if world > 1 else None
    accelerator = Accelerator(parallelism_config=config)
    saved, growth = step(accelerator, seq, world)
    if world > 1:
        values = torch.tensor([saved, growth])
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
        saved, growth = values.tolist()
    if accelerator.is_main_process:
        print(f"MEMORY seq={seq} sp={world} saved_mb={saved:.1f} peak_rss_growth_mb={growth:.1f}", flush=True)


if __name__ == "__main__":
    main()
