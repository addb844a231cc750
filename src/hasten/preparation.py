"""How the ``Accelerator`` handles the objects given to ``prepare``, mixed into the facade.

:class:`PreparationHelpers` sorts ``prepare``'s arguments by kind, adopts objects prepared earlier,
refuses models dispatched with a ``device_map`` and wraps optimizers and schedulers (handing them the Accelerator's
``state`` and ``gradient_state``), registering each prepared object with the ``Accelerator`` (which provides those,
``_strategy``, ``scaler``, the ``_models``, ``_optimizers``, ``_schedulers`` and ``_dataloaders`` lists,
``split_batches``, ``step_scheduler_with_optimizer`` and ``verify_device_map``).
"""

from __future__ import annotations

import torch

from . import environment
from .data_loader import DataLoaderStateMixin
from .errors import ConfigError
from .optimizer import AcceleratedOptimizer
from .scheduler import AcceleratedScheduler


def _mark_prepared(obj):
    """Set Accelerate's ``_is_accelerate_prepared`` flag (libraries check it to avoid preparing twice); returns
    ``obj``."""
    obj._is_accelerate_prepared = True
    return obj


def _is_scheduler(obj) -> bool:
    return isinstance(obj, torch.optim.lr_scheduler.LRScheduler) or (
        hasattr(obj, "step") and hasattr(obj, "optimizer") and hasattr(obj, "get_last_lr")
    )


class PreparationHelpers:
    """The private helpers of :meth:`~hasten.Accelerator.prepare` and its ``prepare_*`` methods."""

    def _kind(self, obj) -> str:
        if (
            getattr(obj, "_is_accelerate_prepared", False)
            or isinstance(obj, (AcceleratedOptimizer, AcceleratedScheduler, DataLoaderStateMixin))
            or any(obj is m for m in self._models)
        ):
            return "prepared"
        if isinstance(obj, torch.nn.Module):
            return "model"
        if isinstance(obj, torch.optim.Optimizer):
            return "optimizer"
        if isinstance(obj, torch.utils.data.DataLoader):
            return "dataloader"
        if _is_scheduler(obj):
            return "scheduler"
        return "other"

    def _adopt(self, prepared) -> None:
        """Track an object prepared earlier (by this Accelerator before ``free_memory``, or by another one), as
        Accelerate does."""
        if isinstance(prepared, AcceleratedOptimizer):
            registry = self._optimizers
        elif isinstance(prepared, AcceleratedScheduler):
            registry = self._schedulers
        elif isinstance(prepared, DataLoaderStateMixin):
            registry = self._dataloaders
        elif isinstance(prepared, torch.nn.Module):
            registry, prepared = self._models, self._strategy.tracked_model(prepared)
        else:
            return
        if not any(prepared is known for known in registry):
            registry.append(prepared)

    def _check_model(self, model: torch.nn.Module) -> None:
        if self.verify_device_map(model) and not environment.get_flag("BYPASS_DEVICE_MAP"):
            raise ConfigError(
                "This model was dispatched across several devices with a device_map, which cannot be prepared for "
                "distributed training. Load it on one device for training, or set "
                f"{environment.variable_name('BYPASS_DEVICE_MAP')}=1 to prepare it anyway (single process only)."
            )

    def _wrap_optimizer(self, optimizer, device_placement: bool, original=None) -> AcceleratedOptimizer:
        wrapped = AcceleratedOptimizer(
            optimizer,
            device_placement=device_placement,
            scaler=self.scaler,
            strategy=self._strategy,
            gradient_state=self.gradient_state,
        )
        wrapped._original = original if original is not None else optimizer
        self._optimizers.append(wrapped)
        return _mark_prepared(wrapped)

    def _wrap_scheduler(self, scheduler) -> AcceleratedScheduler:
        if isinstance(
            scheduler, AcceleratedScheduler
        ):  # a strategy's own prepared scheduler (DeepSpeed's engine steps it)
            self._schedulers.append(scheduler)
            return scheduler
        target = getattr(scheduler, "optimizer", None)
        followed = [
            o
            for o in self._optimizers
            if target is o or target is o.optimizer or target is getattr(o, "_original", None)
        ]
        wrapped = AcceleratedScheduler(
            scheduler,
            followed or self._optimizers,
            step_with_optimizer=self.step_scheduler_with_optimizer,
            split_batches=self.split_batches,
            state=self.state,
            gradient_state=self.gradient_state,
        )
        self._schedulers.append(wrapped)
        return _mark_prepared(wrapped)
