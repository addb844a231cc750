"""Context parallelism on 2 CUDA GPUs (torch's ring attention under FSDP2, as Accelerate runs it):
``hasten launch --num_processes 2 --use_fsdp --parallelism_config_cp_size 2 tests/scripts/cp_training.py``.

Run by bench/device_check.sh where the machine has 2 GPUs (torch 2.13's context_parallel does not run on the CPU:
there is no sharding strategy for aten._scaled_dot_product_flash_attention_for_cpu). A tiny transformers Llama
(sdpa) trains 6 steps in fp32 on 64-token sequences; each step runs inside ``accelerator.maybe_context_parallel``
with the inputs, positions and shifted labels as buffers split along the sequence (load-balanced chunks). Every
step's loss (the mean over the cp ranks of each rank's token mean: equal token counts) must equal, within 1e-4, the
loss of the same model trained on one GPU without context parallelism. Prints ``cp checks passed`` on rank 0.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hasten import Accelerator

STEPS, BATCH, SEQ, VOCAB = 6, 2, 64, 64


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def batches(device):
    generator = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
        labels = F.pad(ids, (0, 1), value=-100)[:, 1:]
        yield ids.to(device), labels.to(device), torch.arange(SEQ).expand(BATCH, SEQ).contiguous().to(device)


def reference(device) -> list[float]:
    model = tiny_llama().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for ids, labels, positions in batches(device):
        logits = model(input_ids=ids, position_ids=positions).logits
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def main():
    accelerator = Accelerator()
    assert accelerator.parallelism_config.cp_enabled and accelerator.context_parallel_rank in (0, 1)
    model = tiny_llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = accelerator.prepare(model, optimizer)
    losses = []
    for ids, labels, positions in batches(accelerator.device):
        with accelerator.maybe_context_parallel(
            buffers=[ids, labels, positions], buffer_seq_dims=[1, 1, 1], no_restore_buffers={ids, labels, positions}
        ):
            logits = model(input_ids=ids, position_ids=positions).logits
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)
            accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / accelerator.num_processes)
    if accelerator.is_main_process:
        expected = reference(accelerator.device)
        worst = max(abs(a - b) for a, b in zip(losses, expected))
        assert worst < 1e-4, (losses, expected)
        print(f"cp losses {losses} (one GPU without cp: {expected}); cp checks passed", flush=True)
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
