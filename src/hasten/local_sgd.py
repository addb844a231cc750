"""Local SGD: each process takes several optimizer steps on its own, then the models are averaged.

``hasten.local_sgd.LocalSGD`` keeps the import path of ``accelerate.local_sgd``.
"""

from __future__ import annotations

import torch

from .errors import ConfigError, NotSupportedError
from .runtime.operations import reduce


class LocalSGD:
    """Context manager for Local SGD: gradients are not reduced between processes; instead every
    ``local_sgd_steps`` calls of :meth:`step` the model parameters are averaged across processes
    (and once more when the block ends).

    Example::

        with LocalSGD(accelerator, model, local_sgd_steps=8) as local_sgd:
            for batch in loader:
                with accelerator.accumulate(model):
                    accelerator.backward(loss_fn(model(batch)))
                    optimizer.step()
                    optimizer.zero_grad()
                    local_sgd.step()

    Args:
        accelerator: the ``Accelerator``.
        model: the prepared model.
        local_sgd_steps: optimizer steps between two averagings.
        enabled: False makes every method a no-op (normal data-parallel training).
    """

    def __init__(self, accelerator, model: torch.nn.Module, local_sgd_steps: int, enabled: bool = True):
        if not isinstance(local_sgd_steps, int) or local_sgd_steps < 1:
            raise ConfigError(f"LocalSGD(local_sgd_steps={local_sgd_steps!r}): give a positive integer.")
        if enabled and not accelerator.replicates_model:
            kind = getattr(accelerator.distributed_type, "value", accelerator.distributed_type)
            raise NotSupportedError(
                f"LocalSGD works with DDP (or one process); {kind} shards the model, so "
                "there is nothing local to average."
            )
        self.accelerator = accelerator
        self.model = model
        self.local_sgd_steps = local_sgd_steps
        self.enabled = enabled and accelerator.num_processes > 1
        self.num_steps = 0
        self._no_sync = None

    def __enter__(self):
        if self.enabled:
            self._no_sync = self.accelerator.no_sync(self.model)
            self._no_sync.__enter__()
        return self

    def __exit__(self, *exc):
        if self.enabled:
            self._sync()
            self._no_sync.__exit__(*exc)

    def step(self) -> None:
        """Count one optimizer step; average the parameters every ``local_sgd_steps`` steps."""
        self.num_steps += 1
        if self.enabled and self.num_steps % self.local_sgd_steps == 0:
            self._sync()

    def _sync(self) -> None:
        self.accelerator.wait_for_everyone()
        parameters = list(self.accelerator.unwrap_model(self.model).parameters())
        with torch.no_grad():  # one reduce call for all parameters: one cross-process input check, not one per tensor
            for param, mean in zip(parameters, reduce([param.data for param in parameters], reduction="mean")):
                param.copy_(mean)
