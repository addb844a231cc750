"""``AcceleratedScheduler``: a learning rate scheduler that follows the optimizer's real steps."""

from __future__ import annotations

import warnings

from .state import AcceleratorState, GradientState, warn_once


class AcceleratedScheduler:
    """Wraps a learning rate scheduler.

    With ``step_with_optimizer`` (the default), ``step()`` advances the schedule only when the optimizer
    really stepped: not while accumulating gradients, and not when fp16 skipped the step because of an
    overflow. Unless ``split_batches``, each real step advances the schedule once per process, as in
    Accelerate, so a schedule written for one process keeps its shape when the global batch grows.

    Args:
        scheduler: the scheduler to wrap.
        optimizers: the prepared optimizer(s) it follows.
        step_with_optimizer: tie steps to real optimizer steps.
        split_batches: the global batch does not grow with the number of processes.
        state, gradient_state: hasten only: the Accelerator's ``AcceleratorState`` (the number of processes) and
            :class:`~hasten.state.GradientState`, which it hands in; a scheduler wrapped by hand (None) reads the
            process's, as in Accelerate.
    """

    def __init__(
        self,
        scheduler,
        optimizers,
        step_with_optimizer: bool = True,
        split_batches: bool = False,
        *,
        state: AcceleratorState | None = None,
        gradient_state: GradientState | None = None,
    ):
        self.scheduler = scheduler
        self.optimizers = optimizers if isinstance(optimizers, (list, tuple)) else [optimizers]
        self.split_batches = split_batches
        self.step_with_optimizer = step_with_optimizer
        self.gradient_state = gradient_state if gradient_state is not None else GradientState()
        self._repeat = 1 if split_batches else (state if state is not None else AcceleratorState()).num_processes

    def step(self, *args, **kwargs) -> None:
        """Advance the schedule if the optimizer really stepped (see the class docstring)."""
        if not self.step_with_optimizer:
            self.scheduler.step(*args, **kwargs)
            return
        if not self.gradient_state.sync_gradients:
            if self.gradient_state.adjust_scheduler:
                self.scheduler._step_count += 1
            return
        if any(getattr(opt, "step_was_skipped", False) for opt in self.optimizers):
            return
        early = not any(getattr(opt, "has_stepped", True) for opt in self.optimizers)
        if early:
            warn_once(
                "scheduler-before-optimizer",
                "lr_scheduler.step() was called before any optimizer.step(): the first value of the schedule is "
                "skipped. Call optimizer.step() before lr_scheduler.step() in the training loop.",
            )
        with warnings.catch_warnings():
            if early:  # torch says the same, less precisely
                warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
            total = getattr(self.scheduler, "total_steps", None)
            for _ in range(self._repeat):
                if total is not None and self.scheduler._step_count > total:
                    break
                self.scheduler.step(*args, **kwargs)

    def get_last_lr(self):
        """The last learning rates computed by the scheduler."""
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict:
        """The wrapped scheduler's state dict."""
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Load the wrapped scheduler's state."""
        self.scheduler.load_state_dict(state_dict)

    def get_lr(self):
        """The wrapped scheduler's ``get_lr()``."""
        return self.scheduler.get_lr()

    def print_lr(self, *args, **kwargs):
        """The wrapped scheduler's ``print_lr()``."""
        return self.scheduler.print_lr(*args, **kwargs)

    def __getattr__(self, name):
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)
