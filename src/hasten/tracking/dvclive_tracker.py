"""DVCLive (needs ``pip install dvclive``): metrics and parameters written by ``dvclive.Live``."""

from __future__ import annotations

from typing import Any

from ._common import SkipReporter, as_step
from .base import GeneralTracker, on_main_process
from .values import tensors_to_numbers


class DVCLiveTracker(GeneralTracker):
    """Logs through a ``dvclive.Live``: the one given, or ``Live(**kwargs)``; each ``log`` call is one step.

    Args:
        run_name: ignored, as in Accelerate (DVCLive names runs itself; pass ``dir=...`` etc. in ``kwargs``).
        live: an existing ``dvclive.Live`` to log to.
        **kwargs: passed to ``dvclive.Live``.
    """

    name = "dvclive"
    requires_logging_directory = False
    _package = "dvclive"

    def __init__(self, run_name: str | None = None, live: Any | None = None, **kwargs):
        super().__init__()
        self.live = live
        self.init_kwargs = kwargs
        self._skips = SkipReporter("dvclive", "a value dvclive.plots.Metric can log (a number)")

    @property
    def tracker(self):
        """The ``dvclive.Live`` (``None`` before ``start`` unless one was given)."""
        return self.live

    @on_main_process
    def start(self) -> None:
        """Create the ``Live`` unless one was given."""
        from dvclive import Live

        if self.live is None:
            self.live = Live(**self.init_kwargs)

    @on_main_process
    def store_init_configuration(self, values: dict) -> None:
        """Record ``values`` with ``Live.log_params`` (DVCLive writes them to its params file)."""
        self.live.log_params(values)

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs) -> None:
        """Log each metric with ``Live.log_metric`` at ``step`` (when given), then advance with ``Live.next_step``."""
        from dvclive.plots import Metric

        step = as_step(step)
        if step is not None:
            self.live.step = step
        for key, value in tensors_to_numbers(values).items():
            if Metric.could_log(value):
                self.live.log_metric(key, value, **kwargs)
            else:
                self._skips.skip(key, value)
        self.live.next_step()

    @on_main_process
    def finish(self) -> None:
        """End the ``Live`` (writes its summary)."""
        if self.live is not None:
            self.live.end()
