"""``DeepSpeedSchedulerWrapper`` on a real DeepSpeed engine (2 processes, ZeRO-2): prepare returns one for
the config's scheduler (``DummyOptim`` + ``DummyScheduler``), for a ``DummyScheduler`` with
``lr_scheduler_callable`` and for the script's own torch scheduler; the engine steps each exactly once
per optimizer step (``scheduler.step()`` in the loop adds nothing) and the learning rates equal the
same schedule stepped by hand; ``state_dict``/``load_state_dict`` reach the engine's scheduler.

Run by tests/strategies/test_deepspeed.py; exits non-zero at the first failure.
"""

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from hasten import Accelerator, DeepSpeedPlugin
from hasten.scheduler import AcceleratedScheduler
from hasten.state import reset_state
from hasten.strategies.deepspeed.strategy import DeepSpeedSchedulerWrapper
from hasten.utils import DummyOptim, DummyScheduler

STEPS = 6
WARMUP = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 4}}


def config(with_optimizer: bool, with_scheduler: bool) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 2}}
    if with_optimizer:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0, "torch_adam": True}}
    if with_scheduler:
        cfg["scheduler"] = WARMUP
    return cfg


def run(cfg, make_optimizer, make_scheduler):
    acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=cfg))
    torch.manual_seed(0)
    raw = torch.nn.Linear(6, 2)
    optimizer = make_optimizer(raw)
    loader = DataLoader(TensorDataset(torch.randn(64, 6), torch.randn(64, 2)), batch_size=4)
    model, optimizer, loader, scheduler = acc.prepare(raw, optimizer, loader, make_scheduler(optimizer))
    assert isinstance(scheduler, DeepSpeedSchedulerWrapper) and isinstance(scheduler, AcceleratedScheduler), type(
        scheduler
    )
    assert acc._schedulers == [scheduler]
    lrs, early = [], None
    for step, (x, y) in enumerate(loader):
        if step == STEPS:
            break
        acc.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        lrs.append(scheduler.get_last_lr()[0])
        early = early or scheduler.state_dict()
    state = scheduler.state_dict()
    scheduler.load_state_dict(early)
    assert model.lr_scheduler.state_dict() == early != state, "load_state_dict reaches the engine's scheduler"
    reset_state()
    return lrs, state


def by_hand(make_scheduler):
    optimizer = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.01)
    scheduler = make_scheduler(optimizer)
    lrs = []
    for _ in range(STEPS):
        optimizer.step()
        scheduler.step()
        lrs.append(scheduler.get_last_lr()[0])
    return lrs, scheduler.state_dict()


def warmup_by_hand(optimizer):
    from deepspeed.runtime.lr_schedules import WarmupLR

    return WarmupLR(optimizer, **WARMUP["params"])


def step_lr(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


expected_warmup = by_hand(warmup_by_hand)
configured = run(config(True, True), lambda m: DummyOptim(m.parameters(), lr=0.01), lambda o: DummyScheduler(o))
assert configured == expected_warmup, (configured, expected_warmup)
callable_ = run(
    config(True, False),
    lambda m: DummyOptim(m.parameters(), lr=0.01),
    lambda o: DummyScheduler(o, lr_scheduler_callable=step_lr),
)
own = run(config(False, False), lambda m: torch.optim.AdamW(m.parameters(), lr=0.01), step_lr)
assert callable_ == own == by_hand(step_lr), (callable_, own, by_hand(step_lr))
print(f"rank {dist.get_rank()}: lrs {configured} {own}")
print(f"rank {dist.get_rank()}: deepspeed scheduler checks passed")
