"""``AcceleratedOptimizer``: steps only when gradients are synchronised, and knows when fp16 skipped a step."""

from __future__ import annotations

import torch

from .errors import ConfigError
from .runtime import preemption
from .runtime.tree import send_to_device
from .state import GradientState, warn_once


def move_to_device(state, device):
    """Move every tensor of a (nested) optimizer state to ``device``."""
    return send_to_device(state, device)


class AcceleratedOptimizer(torch.optim.Optimizer):
    """Wraps an optimizer for the training loop.

    ``step`` and ``zero_grad`` do nothing while gradients are being accumulated (``sync_gradients`` is
    False); under fp16 the step goes through the gradient scaler, and :attr:`step_was_skipped` tells
    whether it was skipped because gradients overflowed. ``param_groups``, ``state``, ``state_dict`` and
    ``load_state_dict`` are the wrapped optimizer's.

    Args:
        optimizer: the optimizer to wrap.
        device_placement: put optimizer state that already exists (an optimizer that stepped, or loaded a
            state dict, before ``prepare`` moved the model) on its parameters' devices.
        scaler: the fp16 ``GradScaler``, if any.
        strategy: hasten only: the Accelerator's strategy, when its engine steps the optimizer itself (DeepSpeed).
        gradient_state: hasten only: the Accelerator's :class:`~hasten.state.GradientState`, which it hands in; an
            optimizer wrapped by hand (None) follows the process's, as in Accelerate.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        device_placement: bool = True,
        scaler=None,
        strategy=None,
        *,
        gradient_state: GradientState | None = None,
    ):
        self.optimizer = optimizer
        self.scaler = scaler
        self.device_placement = device_placement
        engine_owned = strategy is not None and strategy.handles_optimizer_step  # e.g. DeepSpeed places its own state
        if device_placement and optimizer.state and not engine_owned:
            # torch's load_state_dict re-homes each state tensor on its parameter's device (and dtype rules).
            optimizer.load_state_dict(optimizer.state_dict())
        self.gradient_state = gradient_state if gradient_state is not None else GradientState()
        self._strategy = strategy
        self._is_overflow = False
        self._steps = 0

    @property
    def state(self):
        return self.optimizer.state

    @state.setter
    def state(self, value):
        self.optimizer.state = value

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.optimizer.param_groups = value

    @property
    def defaults(self):
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value):
        self.optimizer.defaults = value

    def add_param_group(self, param_group: dict) -> None:
        """Add a parameter group to the wrapped optimizer."""
        self.optimizer.add_param_group(param_group)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load the wrapped optimizer's state (torch moves it to the parameters' devices)."""
        self.optimizer.load_state_dict(state_dict)

    def state_dict(self) -> dict:
        """The wrapped optimizer's state dict."""
        return self.optimizer.state_dict()

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Zero the gradients, except while accumulating (they must add up until the sync step)."""
        if not self.gradient_state.sync_gradients or (
            self._strategy is not None and self._strategy.handles_optimizer_step
        ):
            return
        if set_to_none is None:
            self.optimizer.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def train(self) -> None:
        """Forward ``train()`` to optimizers that have it (schedule-free optimizers)."""
        if hasattr(self.optimizer, "train"):
            self.optimizer.train()

    def eval(self) -> None:
        """Forward ``eval()`` to optimizers that have it (schedule-free optimizers)."""
        if hasattr(self.optimizer, "eval"):
            self.optimizer.eval()

    def step(self, closure=None):
        """Step the optimizer if gradients are synchronised; under fp16 through the scaler."""
        if not self.gradient_state.sync_gradients:
            return None
        self._check_backward_route()
        if self._strategy is not None and self._strategy.handles_optimizer_step:
            result = self._strategy.optimizer_step(self.optimizer, closure)
            self._is_overflow = self._strategy.step_was_skipped
        elif self.scaler is None:
            result = self.optimizer.step(closure) if closure is not None else self.optimizer.step()
            self._is_overflow = False
        else:
            result = self._scaled_step(closure)
        if not self._is_overflow:
            self._steps += 1
        self.gradient_state.record_optimizer_step()
        preemption.after_optimizer_step()
        return result

    def _scaled_step(self, closure):
        inner = self.optimizer
        had_instance_step = "step" in inner.__dict__
        original = inner.step
        called = []

        def recording_step(*args, **kwargs):
            called.append(True)
            return original(*args, **kwargs)

        inner.step = recording_step
        try:
            result = self.scaler.step(inner, closure) if closure is not None else self.scaler.step(inner)
            self.scaler.update()
        except AssertionError as error:
            if "_scale is None" not in str(error):
                raise
            raise ConfigError(
                "optimizer.step() under fp16 found gradients that were never scaled: the loss went through a plain "
                "loss.backward(). Replace loss.backward() with accelerator.backward(loss)."
            ) from None
        finally:
            if had_instance_step:
                inner.step = original
            else:
                del inner.step
        self._is_overflow = not called
        return result

    def _check_backward_route(self) -> None:
        if self.gradient_state.backward_calls > 0:
            return
        if self.scaler is not None or self.gradient_state.num_steps > 1:
            what = (
                "fp16 loss scaling"
                if self.scaler is not None
                else f"gradient accumulation over {self.gradient_state.num_steps} steps"
            )
            warn_once(
                "plain-backward",
                f"optimizer.step() was called but accelerator.backward(loss) was not: with {what} active, a plain "
                "loss.backward() mis-trains silently (gradients are not scaled / not divided). Replace "
                "loss.backward() with accelerator.backward(loss).",
            )

    @property
    def step_was_skipped(self) -> bool:
        """True when the last ``step`` was skipped because fp16 gradients held inf/NaN."""
        return self._is_overflow

    @property
    def has_stepped(self) -> bool:
        """True once the optimizer has really stepped (not skipped) at least once."""
        return self._steps > 0

    def __repr__(self) -> str:
        return f"AcceleratedOptimizer({self.optimizer!r})"

    def __getstate__(self):
        state = self.__dict__.copy()
        state.pop("gradient_state", None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.gradient_state = GradientState()  # unpickled, no Accelerator hands one in: the process's, as in Accelerate


def patch_optimizer_step(accelerated_optimizer, method):
    """``method`` (an optimizer's ``step``) wrapped to record on ``accelerated_optimizer`` that a step was called
    (``_accelerate_step_called``), which scheduler-order warnings read."""

    def patched_step(*args, **kwargs):
        accelerated_optimizer._accelerate_step_called = True
        return method(*args, **kwargs)

    return patched_step
