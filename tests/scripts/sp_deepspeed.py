"""Sequence parallelism under DeepSpeed, the same script on Accelerate 1.15 (the reference copy) and on hasten:
``sp_deepspeed.py OUT_DIR STAGES STREAM BACKEND LOSS`` under torchrun (2 or 4 processes, sp 2).

``import accelerate`` is whichever side ``PYTHONPATH`` puts first (tests/differential.py's ``side_env``). For each ZeRO
stage in STAGES (``1,2,3``) a tiny transformers Llama trains with ``ParallelismConfig(sp_size=2)`` and SGD; the loss
is Accelerate's documented recipe (each part's summed loss, weighted by the valid tokens, gathered with its gradient
over DeepSpeed's sequence-parallel group). Rank 0 writes ``OUT_DIR/result.json``: per stage the loss of every step
(mean over the ranks), the first step's gradients (what SGD moved over the learning rate) and the final parameters,
each compared with one process training the same micro-batches without sequence parallelism.

STREAM ``same``: every base sample is repeated as many times as the side counts processes, so both sides train the
same micro-batches (Accelerate 1.15 on a CPU-only machine counts 1 process per rank under DeepSpeed and does not
shard the loader: with ``ACCELERATE_USE_CPU`` unset its ``_prepare_backend`` finds no device, and with it set it turns
DeepSpeed off). STREAM ``distinct`` (hasten only): every rank reads its own samples, which DeepSpeed's adapter hands to
the ``sp`` group in turn. BACKEND ``deepspeed`` (Accelerate's) or ``accelerate`` (hasten's own Ulysses under
DeepSpeed; hasten only). LOSS ``recipe``: Accelerate's recipe as documented; ``divided``: its loss divided by ``sp``.
Under DeepSpeed's Ulysses with ZeRO-1/2 the recipe's gradients are ``sp`` times those of a run without sequence
parallelism (the recipe's all-gather sums the ranks' gradients, and ZeRO-1/2 sum them again over the ``sp`` ranks
where they average over the data-parallel ones); ZeRO-3's reduce-scatter averages over every rank, so there they are
equal. The result gives the gradients' ratio to the run without sequence parallelism and compares them with that
run's times the expected factor (losses and parameters too where it is 1). On hasten, stages 2 and 3 also save after
2 steps and resume in a new Accelerator.
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin, ParallelismConfig
from accelerate.utils.dataclasses import DeepSpeedSequenceParallelConfig

OUT, STAGES, STREAM = Path(sys.argv[1]), [int(s) for s in sys.argv[2].split(",")], sys.argv[3]
BACKEND, LOSS = sys.argv[4], sys.argv[5]
HASTEN = os.environ.get("HASTEN_DIFFERENTIAL_SIDE") == "hasten"
# dp_shard_size given to ParallelismConfig (SP_TEST_DP_SHARD): Accelerate 1.15 needs it on 4 processes (it sets
# train_batch_size from the configured data-parallel sizes, DeepSpeed checks it against world / sp); hasten does not
DP_SHARD = int(os.environ.get("SP_TEST_DP_SHARD", "0")) or None
STEPS, SEQ, LR, VOCAB, SP = 8, 16, 0.5, 64, 2


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


def base_rows(count: int) -> list[dict]:
    generator = torch.Generator().manual_seed(1)
    rows = []
    for i in range(count):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=generator)
        labels = ids.clone()
        labels[: 3 + (i % 3) * 4] = -100
        rows.append({"input_ids": ids, "labels": labels, "position_ids": torch.arange(SEQ)})
    return rows


def collate(rows):
    return {key: torch.stack([row[key] for row in rows]) for key in rows[0]}


class GatherWithGrad(torch.autograd.Function):
    """Differentiable all-gather of a scalar (torch.distributed.nn's fails on gloo for a group without rank 0)."""

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
    outputs = model(**batch)
    shift_labels = batch["shift_labels"]
    loss = torch.nn.functional.cross_entropy(
        outputs.logits.float().reshape(-1, VOCAB), shift_labels.reshape(-1), ignore_index=-100, reduction="sum"
    )
    goods = [torch.zeros((), dtype=torch.long) for _ in range(dist.get_world_size(group))]
    dist.all_gather(goods, (shift_labels != -100).sum(), group=group)
    loss = GatherWithGrad.apply(loss, group).sum() / torch.stack(goods).sum().clamp(min=1)
    return loss / SP if LOSS == "divided" else loss


def micro_batches(rows, reported: int, world: int) -> list[list[dict]]:
    """Per micro-step, the batch each data-parallel group trains on (DeepSpeed's adapter: group g, refill k, turn j
    takes rank (g*SP + j)'s k-th batch of a loader sharded over ``reported`` processes; hasten's adapter: group g's
    s-th batch of a loader sharded over the groups)."""
    groups = world // SP
    if BACKEND == "accelerate":
        return [[rows[s * groups + g] for g in range(groups)] for s in range(STEPS)]
    steps = []
    for k in range(STEPS // SP):
        for j in range(SP):
            steps.append([rows[(k * reported + g * SP + j) if reported == world else k] for g in range(groups)])
    return steps


def reference(steps):
    model = tiny_llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], None
    for group in steps:
        loss = sum(model(**collate([row])).loss for row in group) / len(group)
        loss.backward()
        grads = grads or {name: p.grad.clone() for name, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, grads, {name: p.detach().clone() for name, p in model.named_parameters()}


def make(stage: int):
    handler = DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation="sdpa")
    config = ParallelismConfig(sp_backend=BACKEND, sp_size=SP, dp_shard_size=DP_SHARD, sp_handler=handler)
    plugin = DeepSpeedPlugin(zero_stage=stage, gradient_clipping=1e6, zero3_save_16bit_model=True)
    return Accelerator(parallelism_config=config, deepspeed_plugin=plugin)


def release():
    """Let the next Accelerator make DeepSpeed's groups and wrap sdpa again: Accelerate cannot do it twice (DeepSpeed
    asserts its groups are made once, and would wrap its own wrapper); hasten does it itself."""
    import deepspeed.runtime.sequence_parallel.parallel_state_sp as groups
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from accelerate.state import AcceleratorState, GradientState

    if not HASTEN:
        groups._SEQUENCE_PARALLEL_GROUP = groups._SEQUENCE_DATA_PARALLEL_GROUP = None
        ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa_attention_forward
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def sp_group(accelerator):
    if BACKEND == "accelerate":
        return accelerator.torch_device_mesh["sp"].get_group()
    from deepspeed.utils import groups

    return groups._get_sequence_parallel_group()


def train(accelerator, rows, steps, checkpoint=None, skip=0):
    model = tiny_llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    loader = DataLoader(rows, batch_size=1, collate_fn=collate)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if checkpoint is not None:
        accelerator.load_state(checkpoint)
    group = sp_group(accelerator)
    before = accelerator.get_state_dict(model) or {}  # ZeRO-3: the main process only
    losses, first = [], None
    for step, batch in enumerate(loader):
        if step < skip:
            continue
        if len(losses) == steps:
            break
        loss = sp_loss(model, batch, group)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach() * (SP if LOSS == "divided" else 1)  # the recipe's value
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
        if first is None:
            after = accelerator.get_state_dict(model) or {}
            first = {name: (before[name] - after[name]) / LR for name in after}
    return model, losses, first


def gradient_factor(stage: int) -> float:
    """The first step's gradients over those of the run without sequence parallelism (see the description)."""
    summed = SP if BACKEND == "deepspeed" and stage < 3 else 1
    return summed / (SP if LOSS == "divided" else 1)


def compare(found, expected, factor: float):
    """Against the run without sequence parallelism: the first step's gradients times ``factor``, and the losses and
    parameters where it is 1."""
    (losses, grads, model_state), (ref_losses, ref_grads, ref_params) = found, expected
    result = {"losses": losses, "factor": factor}
    if factor == 1:
        result["loss_diff"] = max(abs(a - b) for a, b in zip(losses, ref_losses))
    if dist.get_rank() == 0:  # ZeRO-3 gathers the weights on the main process
        big = {k: ref_grads[k].abs() > 1e-4 for k in ref_grads}
        ratios = torch.cat([(grads[k] / ref_grads[k])[big[k]] for k in ref_grads])
        result["grad_ratio"] = [ratios.min().item(), ratios.max().item()]
        result["grad_diff"] = max((grads[k] - factor * ref_grads[k]).abs().max().item() for k in ref_grads)
        if factor == 1:
            result["param_diff"] = max((model_state[k] - ref_params[k]).abs().max().item() for k in ref_params)
            result["param_rel"] = max(
                ((model_state[k] - ref_params[k]).abs().max() / ref_params[k].abs().max()).item() for k in ref_params
            )
        result["grad_sample"] = grads["model.layers.0.self_attn.q_proj.weight"].flatten()[:8].tolist()
        result["param_sample"] = model_state["model.layers.1.mlp.down_proj.weight"].flatten()[:8].tolist()
    return result


def check_resume(stage, rows, expected_losses):
    accelerator = make(stage)
    _, first, _ = train(accelerator, rows, 2)
    folder = accelerator.save_state(str(OUT / f"zero{stage}_checkpoint"))
    release()
    accelerator = make(stage)
    _, rest, _ = train(accelerator, rows, STEPS - 2, checkpoint=folder, skip=2)
    release()
    return max(abs(a - b) for a, b in zip(first + rest, expected_losses))


def main():
    accelerator = make(STAGES[0])
    world, reported = dist.get_world_size(), accelerator.num_processes
    base = base_rows(STEPS * world)
    rows = [row for row in base for _ in range(reported)] if STREAM == "same" else base
    # before any model meets DeepSpeed's Ulysses: it wraps transformers' sdpa for the whole process
    expected = reference(micro_batches(rows, reported, world))
    results = {}
    for index, stage in enumerate(STAGES):
        accelerator = accelerator if index == 0 else make(stage)
        model, losses, grads = train(accelerator, rows, STEPS)
        state = accelerator.get_state_dict(model)
        results[f"zero{stage}"] = compare((losses, grads, state), expected, gradient_factor(stage))
        results[f"zero{stage}"]["mesh"] = str(getattr(accelerator, "torch_device_mesh", None))
        release()
        if HASTEN and stage in (2, 3):
            results[f"zero{stage}"]["resume_diff"] = check_resume(stage, rows, losses)
    if dist.get_rank() == 0:
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / "result.json").write_text(json.dumps(results))
    print(f"rank {dist.get_rank()}: sp deepspeed done", flush=True)


if __name__ == "__main__":
    main()
