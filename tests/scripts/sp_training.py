"""Sequence parallelism with hasten's own Ulysses (sp_backend="accelerate") on real processes:
``sp_training.py ENGINE OUT_DIR`` with ENGINE ``ddp`` or ``fsdp`` (2 processes: sp 2; 4 processes: sp 2 x dp 2).

A tiny transformers Llama (4 query heads, 2 key/value heads) trains on sequences split over the ``sp`` ranks, with
Accelerate's documented loss (each rank's loss over its part, weighted by its valid tokens through a differentiable
all-gather over ``torch_device_mesh["sp"]``). Checked against one process training the same batches without sequence
parallelism, in this process: every step's loss, the gradients of the first step (what SGD moved, over the learning
rate), the parameters after the last step; evaluation through the adapted loader (whole sequences in eval mode) and
``gather_for_metrics``; a checkpoint saved mid-run and resumed in a new Accelerator gives the same last steps. Prints
one ``RESULT`` line per check and ``rank R: sp checks passed``; exits non-zero at the first failure.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from hasten import Accelerator, ParallelismConfig
from hasten.state import reset_state

ENGINE, OUT = sys.argv[1], Path(sys.argv[2])
STEPS, BATCH, SEQ, LR, VOCAB = 4, 2, 16, 0.5, 64
TOL = 2e-5


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def samples(count: int) -> list[dict]:
    """Token rows whose labels hide a prompt of varying length (-100), so the parts hold different token counts."""
    generator = torch.Generator().manual_seed(1)
    rows = []
    for i in range(count):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=generator)
        labels = ids.clone()
        labels[: 3 + (i % 3) * 4] = -100
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def collate(rows):
    return {key: torch.stack([row[key] for row in rows]) for key in rows[0]}


class GatherWithGrad(torch.autograd.Function):
    """A differentiable all-gather of a scalar over ``group`` (backward: every rank's gradient of its own entry,
    summed). torch.distributed.nn.functional.all_gather computes the same, but its backward fails on gloo for a
    group without global rank 0 ('Global rank 0 is not part of group'), as the second sp group of 4 processes is."""

    @staticmethod
    def forward(ctx, value, group):
        ctx.group = group
        parts = [torch.empty_like(value) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, value.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


def sp_loss(model, batch, group):
    """Accelerate's documented sequence-parallel loss: each part's mean over its valid tokens, weighted by them (the
    per-part losses gathered with their gradients)."""
    outputs = model(**batch)
    shift_labels = batch["shift_labels"]
    loss = torch.nn.functional.cross_entropy(
        outputs.logits.float().reshape(-1, VOCAB), shift_labels.reshape(-1), ignore_index=-100, reduction="sum"
    )
    goods = [torch.zeros((), dtype=torch.long) for _ in range(dist.get_world_size(group))]
    dist.all_gather(goods, (shift_labels != -100).sum(), group=group)
    return GatherWithGrad.apply(loss, group).sum() / torch.stack(goods).sum().clamp(min=1)


def reference(rows, replicas: int):
    """One process, no sequence parallelism: per step the mean over the data-parallel replicas' batches of each
    batch's token-mean loss (what DDP/FSDP average); the first step's gradients; the final parameters."""
    model = tiny_llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    batches = [collate(rows[i : i + BATCH]) for i in range(0, len(rows), BATCH)]
    losses, first_grads = [], None
    for step in range(STEPS):
        group = batches[step * replicas : (step + 1) * replicas]
        loss = sum(model(**batch).loss for batch in group) / replicas
        loss.backward()
        if first_grads is None:
            first_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, first_grads, {name: p.detach().clone() for name, p in model.named_parameters()}


def full_state(accelerator, model):
    state = accelerator.get_state_dict(model)
    received = [state]
    dist.broadcast_object_list(received, src=0)  # FSDP gathers the full weights on process 0 only
    return received[0]


def make(engine: str):
    from hasten import FullyShardedDataParallelPlugin

    config = ParallelismConfig(sp_size=2)
    if engine == "fsdp":
        return Accelerator(parallelism_config=config, fsdp_plugin=FullyShardedDataParallelPlugin())
    return Accelerator(parallelism_config=config)


def train(accelerator, rows, steps, start=0, checkpoint=None):
    model = tiny_llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    loader = DataLoader(rows, batch_size=BATCH, collate_fn=collate)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if checkpoint is not None:
        accelerator.load_state(checkpoint)
    group = accelerator.torch_device_mesh["sp"].get_group()
    losses, first = [], None
    before = {name: tensor.clone() for name, tensor in full_state(accelerator, model).items()}
    for step, batch in enumerate(accelerator.skip_first_batches(loader, start) if start else loader):
        if step == steps:
            break
        assert batch["input_ids"].shape[1] == SEQ // 2, "each sp rank holds half of every sequence"
        loss = sp_loss(model, batch, group)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), "mean").item())  # the data-parallel replicas' mean
        if first is None:
            after = full_state(accelerator, model)
            first = {name: (before[name] - after[name]) / LR for name in after}
    return model, loader, losses, first


def check_training(accelerator, rows, expected):
    ref_losses, ref_grads, ref_params = expected
    model, loader, losses, grads = train(accelerator, rows, STEPS)
    loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
    grad_diff = max((grads[name] - ref_grads[name]).abs().max().item() for name in ref_grads)
    params = full_state(accelerator, model)
    param_diff = max((params[name] - ref_params[name]).abs().max().item() for name in ref_params)
    assert len(losses) == STEPS and loss_diff < TOL and grad_diff < TOL and param_diff < TOL, (
        loss_diff,
        grad_diff,
        param_diff,
    )
    return model, loader, {"loss": loss_diff, "grad": grad_diff, "param": param_diff}


def check_evaluation(accelerator, model, loader, rows):
    """Eval mode: whole sequences on every sp rank, the logits of a model without sequence parallelism."""
    reference = tiny_llama()
    reference.load_state_dict(full_state(accelerator, model))
    model.eval()
    worst, gathered = 0.0, []
    with torch.no_grad():
        for batch in loader:
            assert batch["input_ids"].shape[1] == SEQ, "whole sequences in evaluation"
            logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
            expected = reference(input_ids=batch["input_ids"]).logits
            worst = max(worst, (logits - expected).abs().max().item())
            gathered.append(accelerator.gather_for_metrics(batch["input_ids"]))
    model.train()
    assert worst < TOL, worst
    assert torch.equal(torch.cat(gathered), torch.stack([row["input_ids"] for row in rows])), "one copy per sample"
    return worst


def check_resume(engine, rows, expected_losses):
    """Save after 2 steps, resume in a new Accelerator: the last steps' losses are the uninterrupted run's."""
    accelerator = make(engine)
    _, _, first_losses, _ = train(accelerator, rows, 2)
    folder = accelerator.save_state(str(OUT / f"{engine}_checkpoint"))
    reset_state()
    accelerator = make(engine)
    _, _, losses, _ = train(accelerator, rows, STEPS - 2, start=2, checkpoint=folder)
    diff = max(abs(a - b) for a, b in zip(first_losses + losses, expected_losses))
    assert len(losses) == STEPS - 2 and diff < TOL, (diff, losses, expected_losses)
    return diff


def main():
    accelerator = make(ENGINE)
    rank, world = accelerator.process_index, accelerator.num_processes
    replicas = world // 2
    assert accelerator.parallelism_config.sp_backend == "accelerate"
    assert accelerator.torch_device_mesh["sp"].size() == 2
    rows = samples(BATCH * STEPS * replicas)
    expected = reference(rows, replicas)
    model, loader, diffs = check_training(accelerator, rows, expected)
    print(f"RESULT {ENGINE} training: {json.dumps(diffs)} | engine {accelerator.distributed_type}", flush=True)
    eval_rows = rows[: BATCH * replicas * 2]
    eval_loader = accelerator.prepare_data_loader(DataLoader(eval_rows, batch_size=BATCH, collate_fn=collate))
    eval_loader = accelerator.deepspeed_ulysses_dl_adapter(eval_loader, model)
    print(f"RESULT {ENGINE} evaluation: {check_evaluation(accelerator, model, eval_loader, eval_rows):.2e} |")
    reset_state()
    if replicas == 1:
        print(f"RESULT {ENGINE} resume: {check_resume(ENGINE, rows, expected[0]):.2e} |", flush=True)
    print(f"rank {rank}: sp checks passed", flush=True)


if __name__ == "__main__":
    main()
