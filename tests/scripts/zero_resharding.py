"""ZeRO checkpoints resumed on another number of processes: ``zero_resharding.py ROOT STAGES ACTION...`` under
torchrun.

``import accelerate`` is whichever side ``PYTHONPATH`` puts first (tests/differential.py's ``side_env``). A tiny
transformer with tied input and output embeddings trains with AdamW and a LambdaLR schedule in fp32 under each ZeRO
stage of STAGES (``1,2,3``). Every optimizer step trains on the next global batch of ``GLOBAL`` samples; each process
takes its own slice of it (the reference copy counts one process per rank on a CPU machine under DeepSpeed, so there
every process takes the whole batch, which ZeRO's average over the processes leaves the same).

Actions:

* ``save``: train ``FIRST`` steps and ``save_state`` to ``ROOT/<side>/zero<stage>_w<processes>``.
* ``resume:<N>`` (hasten): train ``FIRST + NEXT`` steps without a break, then, in a new Accelerator, ``load_state`` the
  checkpoint hasten saved on N processes and train ``NEXT`` steps; the losses, the fp32 weights and Adam's moments
  must match within ``RELATIVE``, and the module's weights must be the fp32 master weights right after the load.
* ``accelerate:<N>`` (hasten): the same from the checkpoint the reference copy saved on N processes.
* ``save-bf16`` and ``resume-bf16:<N>`` (hasten): the same model in bf16 mixed precision, saved to
  ``ROOT/hasten/zero<stage>_bf16_w<processes>``; after the load on another number of processes the masters and
  moments must be the saved ones, the module's bf16 weights the masters, and the next steps' losses finite.

After every load the fp32 masters and Adam's moments are the saved ones bit for bit.

Prints ``rank R: <action> zero<stage> passed`` per stage and action (and hasten's info line about the new
partitioning); exits non-zero at the first failure.
"""

import logging
import math
import os
import sys
from pathlib import Path

import deepspeed
import torch
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
from torch.utils.data import DataLoader, TensorDataset

from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import DeepSpeedPlugin

SIDE = "hasten" if os.environ.get("HASTEN_DIFFERENTIAL_SIDE", "hasten") == "hasten" else "accelerate"
VOCAB, WIDTH, LENGTH, GLOBAL, FIRST, NEXT = 32, 16, 8, 4, 3, 3
RELATIVE = 1e-6
SUFFIX = {"no": "", "bf16": "_bf16"}
torch.manual_seed(0)
TOKENS = torch.randint(0, VOCAB, (GLOBAL * (FIRST + NEXT), LENGTH + 1))


class TinyTransformer(torch.nn.Module):
    """One causal attention block; the output projection is the input embedding (tied weights)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.qkv = torch.nn.Linear(WIDTH, 3 * WIDTH, bias=False)  # a key bias has no gradient but rounding noise
        self.proj = torch.nn.Linear(WIDTH, WIDTH)
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.up = torch.nn.Linear(WIDTH, 2 * WIDTH)
        self.down = torch.nn.Linear(2 * WIDTH, WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("mask", torch.ones(LENGTH, LENGTH).tril().bool())

    def forward(self, tokens):
        h = self.embed(tokens)
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        scores = (q @ k.transpose(-1, -2) / math.sqrt(WIDTH)).masked_fill(~self.mask, float("-inf"))
        h = h + self.proj(scores.softmax(-1) @ v)
        h = h + self.down(torch.nn.functional.gelu(self.up(self.norm(h))))
        return self.head(h)


def world() -> tuple[int, int]:
    """(rank, processes) of the data: the reference copy's processes each take the whole batch."""
    if SIDE == "accelerate":
        return 0, 1
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def build(stage: int, precision: str = "no"):
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    plugin = DeepSpeedPlugin(zero_stage=stage, gradient_clipping=1e6)  # Accelerate would fill in 1.0
    if SIDE == "accelerate":  # it counts one process: give DeepSpeed the batch sizes of its processes itself
        plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = GLOBAL
        plugin.deepspeed_config["train_batch_size"] = GLOBAL * int(os.environ["WORLD_SIZE"])
    accelerator = Accelerator(deepspeed_plugin=plugin, mixed_precision=precision)
    torch.manual_seed(1)
    raw = TinyTransformer()
    optimizer = torch.optim.AdamW(raw.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + 0.1 * step))
    loader = DataLoader(TensorDataset(TOKENS), batch_size=GLOBAL // world()[1])
    model, optimizer, _, scheduler = accelerator.prepare(raw, optimizer, loader, scheduler)
    return accelerator, model, optimizer, scheduler


def train(accelerator, model, optimizer, scheduler, first: int, count: int) -> list[float]:
    rank, processes = world()
    share = GLOBAL // processes
    losses = []
    for step in range(first, first + count):
        batch = TOKENS[step * GLOBAL + rank * share : step * GLOBAL + (rank + 1) * share]
        logits = model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), "mean").item() if processes > 1 else loss.item())
    return losses


def full_state(model) -> dict[str, torch.Tensor]:
    """Every parameter's fp32 master weight and Adam moments, gathered (a collective under ZeRO-3)."""
    state = {}
    for name, param in model.module.named_parameters():
        state[name] = safe_get_full_fp32_param(param).clone()
        for key in ("exp_avg", "exp_avg_sq"):
            state[f"{name}:{key}"] = safe_get_full_optimizer_state(param, key).clone()
    return state


def check_loaded(model, stage: int, folder: Path) -> None:
    """Right after the load: the fp32 masters and Adam's moments are the saved ones, bit for bit, and the module's
    weights (bf16 or fp32) are the masters in the module's precision."""
    from hasten.strategies.deepspeed.resharding import read_zero_checkpoint

    saved = read_zero_checkpoint(folder)
    state = full_state(model)
    for name, param in model.module.named_parameters():
        assert torch.equal(state[name], saved.weights[name]), f"zero{stage}: master of {name} differs from the saved"
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[f"{name}:{key}"], saved.optimizer_state[name][key]), f"zero{stage}: {name} {key}"
        with deepspeed.zero.GatheredParameters([param], enabled=stage == 3):
            master = state[name].to(param.dtype)
            assert torch.equal(param.data.cpu(), master), f"zero{stage}: module weight {name} is not its master"


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


class _WritesNothing:
    """torch for Accelerate's checkpointing module, whose ``save`` writes nothing."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def save(*args, **kwargs):
        return None


def write_from_rank_zero_only() -> None:
    """Accelerate 1.15 counts every CPU process as the main one under DeepSpeed, so its processes would write the same
    random_states_0.pkl and scheduler.bin at once (a torn file); here only rank 0 writes them (DeepSpeed's own files
    are untouched)."""
    import accelerate.checkpointing

    accelerate.checkpointing.torch = _WritesNothing()
    accelerate.checkpointing.save = _WritesNothing.save


def save(root: Path, stage: int, precision: str = "no") -> None:
    if SIDE == "accelerate" and int(os.environ["RANK"]) > 0:
        write_from_rank_zero_only()
    accelerator, model, optimizer, scheduler = build(stage, precision)
    train(accelerator, model, optimizer, scheduler, 0, FIRST)
    accelerator.save_state(str(root / SIDE / f"zero{stage}{SUFFIX[precision]}_w{os.environ['WORLD_SIZE']}"))
    accelerator.wait_for_everyone()


def resume_bf16(stage: int, folder: Path) -> None:
    """Under bf16 (files named bf16_zero_pp_rank_*) the loaded state is the saved one and training goes on."""
    accelerator, model, optimizer, scheduler = build(stage, "bf16")
    accelerator.load_state(str(folder))
    check_loaded(model, stage, folder)
    losses = train(accelerator, model, optimizer, scheduler, FIRST, NEXT)
    assert all(math.isfinite(loss) for loss in losses), losses


def resume(stage: int, folder: Path) -> None:
    accelerator, model, optimizer, scheduler = build(stage)
    expected = train(accelerator, model, optimizer, scheduler, 0, FIRST + NEXT)[FIRST:]
    expected_state, expected_lr = full_state(model), scheduler.get_last_lr()
    accelerator, model, optimizer, scheduler = build(stage)
    accelerator.load_state(str(folder))
    check_loaded(model, stage, folder)
    resumed = train(accelerator, model, optimizer, scheduler, FIRST, NEXT)
    for a, b in zip(resumed, expected):
        assert abs(a - b) <= RELATIVE * abs(b), f"zero{stage} from {folder.name}: losses {resumed} != {expected}"
    assert scheduler.get_last_lr() == expected_lr, (scheduler.get_last_lr(), expected_lr)
    state = full_state(model)
    worst = max(relative(state[key], expected_state[key]) for key in expected_state)
    assert worst <= RELATIVE, f"zero{stage} from {folder.name}: weights or moments differ by {worst} (relative)"


def main():
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("hasten.deepspeed").setLevel(logging.INFO)  # the line saying the checkpoint was partitioned again
    root, stages = Path(sys.argv[1]), [int(s) for s in sys.argv[2].split(",")]
    for action in sys.argv[3:]:
        kind, _, saved = action.partition(":")
        for stage in stages:
            if kind.startswith("save"):
                save(root, stage, "bf16" if kind == "save-bf16" else "no")
            elif kind == "resume-bf16":
                resume_bf16(stage, root / "hasten" / f"zero{stage}_bf16_w{saved}")
            else:
                side = "hasten" if kind == "resume" else "accelerate"
                resume(stage, root / side / f"zero{stage}_w{saved}")
            print(f"rank {os.environ['RANK']}: {action} zero{stage} passed", flush=True)
    leave_the_group()


def leave_the_group() -> None:
    """End the process group while the interpreter is whole: a process leaving with its gloo group alive can abort
    in the group's teardown ("terminate called without an active exception"; hasten does this at exit itself, the
    reference copy does not)."""
    import time

    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    time.sleep(0.1)


if __name__ == "__main__":
    main()
