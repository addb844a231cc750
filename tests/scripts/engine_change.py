"""Checkpoints resumed under another engine: ``engine_change.py ROOT STAGES ACTION...`` under torchrun (hasten).

The model, data and loop are tests/scripts/zero_resharding.py's (a tiny transformer with tied weights and a LambdaLR
schedule in fp32; each optimizer step trains on the next global batch, every process on its slice), with AdamW in two
parameter groups (weight decay on the matrices only), so that the groups are matched across engines too.

Actions (``<N>``: the processes that saved the checkpoint):

* ``save-ddp``: train ``FIRST`` steps under DDP (one process: no wrapper) and ``save_state`` to ``ROOT/ddp_w<P>``.
  With ``split_batches`` the prepared scheduler advances once per optimizer step, as the DeepSpeed engine's does
  (without it, once per process per step), so that the schedules of both engines are the same.
* ``save-zero``: the same under each ZeRO stage of STAGES, to ``ROOT/zero<stage>_w<P>``.
* ``ddp-to-zero:<N>``: under each stage, train ``FIRST + NEXT`` steps without a break, then in a new Accelerator
  ``load_state`` the DDP checkpoint of N processes (right after it the fp32 masters are the saved weights and Adam's
  moments the saved ones, bit for bit) and train ``NEXT`` steps.
* ``zero-to-ddp:<N>``: under DDP, the same from the ZeRO checkpoint of each stage saved on N processes.

After each resume the next steps' losses, the weights and Adam's moments match the run that never stopped within
``RELATIVE``, and the scheduler's learning rate is the same. Prints ``rank R: <action> <engine> passed`` per resume;
exits non-zero at the first failure.
"""

import logging
import os
import sys
import warnings
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset
from zero_resharding import (
    FIRST,
    GLOBAL,
    NEXT,
    RELATIVE,
    TOKENS,
    TinyTransformer,
    leave_the_group,
    relative,
    train,
)

from hasten import Accelerator, DataLoaderConfiguration, DeepSpeedPlugin
from hasten.checkpointing.accelerate_format import open_checkpoint
from hasten.state import AcceleratorState, GradientState
from hasten.strategies.deepspeed.resharding import read_zero_checkpoint

WORLD = int(os.environ["WORLD_SIZE"])
LEFT_BEHIND = "carry over;"


def build(stage: int | None = None):
    """The model, AdamW with two groups (weight decay on the matrices only, as transformers' Trainer makes them), the
    schedule and a loader, under ZeRO ``stage`` or, without one, under DDP."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    if stage is None:
        accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(split_batches=True))
    else:
        accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=stage, gradient_clipping=1e6))
    torch.manual_seed(1)
    raw = TinyTransformer()
    matrices = [p for p in raw.parameters() if p.dim() >= 2]
    others = [p for p in raw.parameters() if p.dim() < 2]
    groups = [{"params": matrices, "weight_decay": 0.01}, {"params": others, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + 0.1 * step))
    loader = DataLoader(TensorDataset(TOKENS), batch_size=GLOBAL if stage is None else GLOBAL // WORLD)
    model, optimizer, _, scheduler = accelerator.prepare(raw, optimizer, loader, scheduler)
    return accelerator, model, optimizer, scheduler


def zero_state(accelerator, folder: Path) -> dict[str, torch.Tensor]:
    """Every parameter's fp32 master and Adam moments under ZeRO, read by name from a ``save_state`` into ``folder``
    (DeepSpeed's safe_get_full_optimizer_state fails on 2 processes with two groups: 'exp_avg not found in optimizer
    state fragment')."""
    accelerator.save_state(str(folder))
    accelerator.wait_for_everyone()
    full = read_zero_checkpoint(folder)
    state = dict(full.weights)
    for name, entry in full.optimizer_state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            state[f"{name}:{key}"] = entry[key]
    return state


def torch_state(accelerator, model, optimizer) -> dict[str, torch.Tensor]:
    """Every parameter's weight and Adam moments, as full_state gives them under ZeRO."""
    state = {}
    for name, param in accelerator.unwrap_model(model).named_parameters():
        state[name] = param.detach().clone()
        for key in ("exp_avg", "exp_avg_sq"):
            state[f"{name}:{key}"] = optimizer.optimizer.state[param][key].clone()
    return state


def check_resumed(what: str, resumed: list, expected: list, state: dict, expected_state: dict) -> None:
    for a, b in zip(resumed, expected):
        assert abs(a - b) <= RELATIVE * abs(b), f"{what}: losses {resumed} != {expected}"
    worst = max(relative(state[key], expected_state[key]) for key in expected_state)
    assert worst <= RELATIVE, f"{what}: weights or moments differ by {worst} (relative)"


def check_loaded_from_torch(accelerator, model, folder: Path, probe: Path) -> None:
    """Right after the load: the fp32 masters are the saved weights and the moments the saved ones, bit for bit."""
    reader = open_checkpoint(folder, 0, [model])
    weights = reader.load_tensors("model.safetensors")
    saved = reader.load_state("optimizer")
    loaded = zero_state(accelerator, probe)
    params = dict(model.module.named_parameters())
    matrices = [name for name, param in params.items() if len(getattr(param, "ds_shape", param.shape)) >= 2]
    order = matrices + [name for name in params if name not in matrices]  # the optimizer's groups, in order
    for position, name in enumerate(order):
        assert torch.equal(loaded[name], weights[name]), f"master of {name} is not the saved weight"
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(loaded[f"{name}:{key}"], saved["state"][position][key]), f"{name} {key}"


def ddp_to_zero(stage: int, folder: Path) -> None:
    probe = folder.parent / f"probe_zero{stage}_from_{folder.name}_w{WORLD}"
    accelerator, model, optimizer, scheduler = build(stage)
    expected = train(accelerator, model, optimizer, scheduler, 0, FIRST + NEXT)[FIRST:]
    expected_state, expected_lr = zero_state(accelerator, probe / "uninterrupted"), scheduler.get_last_lr()
    accelerator, model, optimizer, scheduler = build(stage)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accelerator.load_state(str(folder))
    said = [str(w.message) for w in caught if LEFT_BEHIND in str(w.message)]
    assert len(said) == (1 if accelerator.is_main_process else 0), said
    check_loaded_from_torch(accelerator, model, folder, probe / "loaded")
    resumed = train(accelerator, model, optimizer, scheduler, FIRST, NEXT)
    assert scheduler.get_last_lr() == expected_lr, (scheduler.get_last_lr(), expected_lr)
    state = zero_state(accelerator, probe / "resumed")
    check_resumed(f"zero{stage} from {folder.name}", resumed, expected, state, expected_state)


def zero_to_ddp(folder: Path) -> None:
    accelerator, model, optimizer, scheduler = build()
    expected = train(accelerator, model, optimizer, scheduler, 0, FIRST + NEXT)[FIRST:]
    expected_state = torch_state(accelerator, model, optimizer)
    expected_lr = scheduler.get_last_lr()
    accelerator, model, optimizer, scheduler = build()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accelerator.load_state(str(folder))
    said = [str(w.message) for w in caught if LEFT_BEHIND in str(w.message)]
    assert len(said) == (1 if accelerator.is_main_process else 0), said
    resumed = train(accelerator, model, optimizer, scheduler, FIRST, NEXT)
    assert scheduler.get_last_lr() == expected_lr, (scheduler.get_last_lr(), expected_lr)
    state = torch_state(accelerator, model, optimizer)
    check_resumed(f"ddp from {folder.name}", resumed, expected, state, expected_state)


def main():
    logging.basicConfig(level=logging.WARNING)
    root, stages = Path(sys.argv[1]), [int(s) for s in sys.argv[2].split(",")]
    rank = os.environ["RANK"]
    for action in sys.argv[3:]:
        kind, _, saved = action.partition(":")
        if kind == "save-ddp":
            accelerator, model, optimizer, scheduler = build()
            train(accelerator, model, optimizer, scheduler, 0, FIRST)
            accelerator.save_state(str(root / f"ddp_w{WORLD}"))
            print(f"rank {rank}: {action} ddp passed", flush=True)
        for stage in stages:
            if kind == "save-zero":
                accelerator, model, optimizer, scheduler = build(stage)
                train(accelerator, model, optimizer, scheduler, 0, FIRST)
                accelerator.save_state(str(root / f"zero{stage}_w{WORLD}"))
            elif kind == "ddp-to-zero":
                ddp_to_zero(stage, root / f"ddp_w{saved}")
            elif kind == "zero-to-ddp":
                zero_to_ddp(root / f"zero{stage}_w{saved}")
            else:
                continue
            print(f"rank {rank}: {action} zero{stage} passed", flush=True)
    leave_the_group()


if __name__ == "__main__":
    main()
