"""The shape the wandb, SwanLab and trackio trackers share: one run, made on the main process by
``<package>.init(project=run_name, **kwargs)``, logged to with ``run.log`` and closed with ``run.finish``."""

from __future__ import annotations

import importlib

from ._common import as_step
from .base import GeneralTracker, on_main_process
from .values import tensors_to_numbers


class ProjectRunTracker(GeneralTracker):
    """A tracker whose run is ``<_package>.init(project=run_name, **kwargs)``; subclasses name the package and add
    what differs (how the configuration and images are stored).

    Args:
        run_name: the project name given to ``init_trackers``.
        **kwargs: passed to the package's ``init``.
    """

    requires_logging_directory = False

    def __init__(self, run_name: str, **kwargs):
        super().__init__()
        self.run_name = run_name
        self.init_kwargs = kwargs
        self.run = None

    @property
    def tracker(self):
        """The run (``None`` before ``start``)."""
        return self.run

    @on_main_process
    def start(self) -> None:
        """Create the run with the package's ``init``."""
        self.run = importlib.import_module(self._package).init(project=self.run_name, **self.init_kwargs)

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs) -> None:
        """Log ``values`` with ``run.log``.

        Args:
            values: name -> value; one-element tensors are converted to numbers.
            step: the step (wandb requires it to never decrease within a run).
            **kwargs: passed to ``run.log`` (e.g. wandb's ``commit``, SwanLab's ``print_to_console``).
        """
        self.run.log(tensors_to_numbers(values), step=as_step(step), **kwargs)

    @on_main_process
    def finish(self) -> None:
        """Finish the run (uploads, or closes the offline run's files)."""
        if self.run is not None:
            self.run.finish()
