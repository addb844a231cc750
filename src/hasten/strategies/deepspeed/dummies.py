"""Stand-ins a script passes to ``prepare`` for the optimizer and scheduler of the DeepSpeed config, and the
CPU optimizers optimizer offload needs.

Importing this module does not import ``deepspeed``.
"""

from __future__ import annotations

import copy
from typing import Callable

import torch

from ...errors import ConfigError


class DummyOptim(torch.optim.Optimizer):
    """Stands for the optimizer defined in the DeepSpeed config's ``optimizer`` section.

    Pass it to ``prepare`` instead of a torch optimizer; its values fill the section's ``"auto"`` params,
    and ``prepare`` returns the engine's optimizer in its place.

    Args:
        params: the model's parameters (or parameter groups).
        lr: learning rate.
        weight_decay: weight decay.
        **kwargs: other optimizer params (``betas``, ``eps``, ...).
    """

    def __init__(self, params, lr: float = 0.001, weight_decay: float = 0, **kwargs):
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay, **kwargs})
        self.lr = lr
        self.weight_decay = weight_decay
        self.kwargs = kwargs

    @property
    def params(self) -> list[dict]:
        """The parameter groups, without the values the config's optimizer sets (for ``deepspeed.initialize``)."""
        return [
            {k: v for k, v in group.items() if k not in self.defaults or v != self.defaults[k]}
            for group in self.param_groups
        ]

    def step(self, closure=None):
        """Refuses to run: the DeepSpeed engine replaces this optimizer at ``prepare``."""
        raise ConfigError(
            "DummyOptim cannot step: pass it to accelerator.prepare() and use the optimizer prepare() returns."
        )


class DummyScheduler:
    """Stands for the scheduler defined in the DeepSpeed config's ``scheduler`` section.

    Args:
        optimizer: the ``DummyOptim`` (or optimizer) it schedules.
        total_num_steps: optimizer steps of the whole run (fills ``total_num_steps``).
        warmup_num_steps: warm-up steps (fills ``warmup_num_steps``).
        lr_scheduler_callable: ``callable(optimizer) -> scheduler`` building the scheduler instead of the config.
        **kwargs: other scheduler params.
    """

    def __init__(
        self,
        optimizer,
        total_num_steps: int | None = None,
        warmup_num_steps: int = 0,
        lr_scheduler_callable: Callable | None = None,
        **kwargs,
    ):
        self.optimizer = optimizer
        self.total_num_steps = total_num_steps
        self.warmup_num_steps = warmup_num_steps
        self.lr_scheduler_callable = lr_scheduler_callable
        self.kwargs = kwargs

    def step(self, *args, **kwargs) -> None:
        """Refuses to run: the DeepSpeed engine replaces this scheduler at ``prepare``."""
        raise ConfigError(
            "DummyScheduler cannot step: pass it to accelerator.prepare() and use the scheduler prepare() returns."
        )

    def get_last_lr(self) -> list[float]:
        """The learning rates of the optimizer's groups."""
        return [group["lr"] for group in self.optimizer.param_groups]


def map_pytorch_optim_to_deepspeed(optimizer):
    """Replace a torch Adam/AdamW/Adagrad by DeepSpeed's CPU implementation (needed for optimizer offload).

    The new optimizer has the same parameter groups and hyperparameters; other optimizers are returned
    unchanged (DeepSpeed then needs ``"zero_force_ds_cpu_optimizer": false`` to offload them).
    """
    from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    groups = [copy.copy(group) for group in optimizer.param_groups]
    if isinstance(optimizer, torch.optim.AdamW) or (
        isinstance(optimizer, torch.optim.Adam) and optimizer.defaults.get("decoupled_weight_decay")
    ):
        return DeepSpeedCPUAdam(groups, lr=optimizer.defaults["lr"], adamw_mode=True)
    if isinstance(optimizer, torch.optim.Adam):
        return DeepSpeedCPUAdam(groups, lr=optimizer.defaults["lr"], adamw_mode=False)
    if isinstance(optimizer, torch.optim.Adagrad):
        return DeepSpeedCPUAdagrad(groups, lr=optimizer.defaults["lr"])
    return optimizer
