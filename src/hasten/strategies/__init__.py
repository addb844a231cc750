"""Distribution engines behind one interface (:class:`Strategy`), and the one place that picks one."""

from __future__ import annotations

from .base import Strategy
from .ddp import DDPStrategy
from .single import SingleDeviceStrategy


def select_strategy(state, precision, *, ddp_kwargs=None) -> Strategy:
    """Pick the strategy for this process: DDP when several processes run, a single device otherwise."""
    if state.num_processes > 1:
        return DDPStrategy(state, precision, ddp_kwargs=ddp_kwargs)
    return SingleDeviceStrategy(state, precision)


__all__ = ["DDPStrategy", "SingleDeviceStrategy", "Strategy", "select_strategy"]
