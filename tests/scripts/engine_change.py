"""Checkpoints resumed under another engine: ``engine_change.py ROOT STAGES ACTION...`` under torchrun (hasten).

The model, data and loop are tests/scripts/zero_resharding.py's (a tiny transformer with tied weights, AdamW and a
LambdaLR schedule in fp32; each optimizer step trains on the next global batch, every process on its slice).

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
    build,
    full_state,
    leave_the_group,
    relative,
    train,
)

from hasten import Accelerator, DataLoaderConfiguration
from hasten.checkpointing.accelerate_format import open_checkpoint
from hasten.state import AcceleratorState, GradientState

WORLD = int(os.environ["WORLD_SIZE"])
LEFT_BEHIND = "carry over;"


def build_ddp():
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(split_batches=True))
    torch.manual_seed(1)
    raw = TinyTransformer()
    optimizer = torch.optim.AdamW(raw.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + 0.1 * step))
    loader = DataLoader(TensorDataset(TOKENS), batch_size=GLOBAL)
    model, optimizer, _, scheduler = accelerator.prepare(raw, optimizer, loader, scheduler)
    return accelerator, model, optimizer, scheduler


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


def check_loaded_from_torch(model, folder: Path) -> None:
    """Right after the load: the fp32 masters are the saved weights and the moments the saved ones, bit for bit."""
    reader = open_checkpoint(folder, 0, [model])
    weights = reader.load_tensors("model.safetensors")
    saved = reader.load_state("optimizer")
    loaded = full_state(model)
    for position, (name, _) in enumerate(model.module.named_parameters()):
        assert torch.equal(loaded[name], weights[name]), f"master of {name} is not the saved weight"
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(loaded[f"{name}:{key}"], saved["state"][position][key]), f"{name} {key}"


def ddp_to_zero(stage: int, folder: Path) -> None:
    accelerator, model, optimizer, scheduler = build(stage)
    expected = train(accelerator, model, optimizer, scheduler, 0, FIRST + NEXT)[FIRST:]
    expected_state, expected_lr = full_state(model), scheduler.get_last_lr()
    accelerator, model, optimizer, scheduler = build(stage)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accelerator.load_state(str(folder))
    said = [str(w.message) for w in caught if LEFT_BEHIND in str(w.message)]
    assert len(said) == (1 if accelerator.is_main_process else 0), said
    check_loaded_from_torch(model, folder)
    resumed = train(accelerator, model, optimizer, scheduler, FIRST, NEXT)
    assert scheduler.get_last_lr() == expected_lr, (scheduler.get_last_lr(), expected_lr)
    check_resumed(f"zero{stage} from {folder.name}", resumed, expected, full_state(model), expected_state)


def zero_to_ddp(folder: Path) -> None:
    accelerator, model, optimizer, scheduler = build_ddp()
    expected = train(accelerator, model, optimizer, scheduler, 0, FIRST + NEXT)[FIRST:]
    expected_state = torch_state(accelerator, model, optimizer)
    expected_lr = scheduler.get_last_lr()
    accelerator, model, optimizer, scheduler = build_ddp()
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
            accelerator, model, optimizer, scheduler = build_ddp()
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
