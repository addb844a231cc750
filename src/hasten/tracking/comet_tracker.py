"""Comet (needs ``pip install comet-ml``; API keys come from Comet's own config file or environment)."""

from __future__ import annotations

from ._common import as_step, is_number
from .base import GeneralTracker, on_main_process
from .values import tensors_to_numbers


class CometMLTracker(GeneralTracker):
    """Logs to a Comet experiment made with ``comet_ml.start(project_name=run_name, **kwargs)``.

    comet_ml releases without ``comet_ml.start`` (before 3.41) get
    ``comet_ml.Experiment(project_name=run_name, **kwargs)``.

    Args:
        run_name: the project name given to ``init_trackers``.
        **kwargs: passed to ``comet_ml.start`` (``workspace``, ``experiment_key``, ``mode``, ``online``, ...).
    """

    name = "comet_ml"
    requires_logging_directory = False
    _package = "comet_ml"

    def __init__(self, run_name: str, **kwargs):
        super().__init__()
        self.run_name = run_name
        self.init_kwargs = kwargs
        self.writer = None

    @property
    def tracker(self):
        """The Comet experiment (``None`` before ``start``)."""
        return self.writer

    @on_main_process
    def start(self) -> None:
        """Start (or resume) the experiment."""
        import comet_ml

        begin = getattr(comet_ml, "start", None)
        if begin is not None:
            self.writer = begin(project_name=self.run_name, **self.init_kwargs)
        else:
            self.writer = comet_ml.Experiment(project_name=self.run_name, **self.init_kwargs)

    @on_main_process
    def store_init_configuration(self, values: dict) -> None:
        """Record ``values`` as the experiment's parameters."""
        self.writer.log_parameters(values)

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs) -> None:
        """Numbers go to ``log_metric``, strings to ``log_other``, dicts of numbers to ``log_metrics``.

        Args:
            values: name -> value; one-element tensors are converted to numbers.
            step: the step (also set as the experiment's current step).
            **kwargs: passed to the Comet call.
        """
        step = as_step(step)
        if step is not None:
            self.writer.set_step(step)
        for key, value in tensors_to_numbers(values).items():
            if is_number(value):
                self.writer.log_metric(key, value, step=step, **kwargs)
            elif isinstance(value, str):
                self.writer.log_other(key, value, **kwargs)
            elif isinstance(value, dict):
                self.writer.log_metrics(value, step=step, **kwargs)

    @on_main_process
    def finish(self) -> None:
        """End the experiment (uploads what is left)."""
        if self.writer is not None:
            self.writer.end()
