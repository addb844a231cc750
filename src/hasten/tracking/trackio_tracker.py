"""Trackio (needs ``pip install trackio``): a local-first tracker with the wandb-like ``init``/``log``/``finish``
API."""

from __future__ import annotations

from ._common import as_step
from .base import GeneralTracker, on_main_process
from .values import tensors_to_numbers


class TrackioTracker(GeneralTracker):
    """Logs to a run made with ``trackio.init(project=run_name, **kwargs)``.

    Note:
        One run is made, by the main process (see :class:`~hasten.tracking.WandBTracker`).

    Args:
        run_name: the project name given to ``init_trackers``.
        **kwargs: passed to ``trackio.init`` (``name``, ``space_id``, ``config``, ...).
    """

    name = "trackio"
    requires_logging_directory = False
    _package = "trackio"

    def __init__(self, run_name: str, **kwargs):
        super().__init__()
        self.run_name = run_name
        self.init_kwargs = kwargs
        self.run = None

    @property
    def tracker(self):
        """The trackio run (``None`` before ``start``)."""
        return self.run

    @on_main_process
    def start(self) -> None:
        """Create the run."""
        import trackio

        self.run = trackio.init(project=self.run_name, **self.init_kwargs)

    @on_main_process
    def store_init_configuration(self, values: dict) -> None:
        """Add ``values`` to the run's config."""
        import trackio

        trackio.config.update(values, allow_val_change=True)

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs) -> None:
        """Log ``values`` with ``run.log`` (``kwargs`` go along)."""
        self.run.log(tensors_to_numbers(values), step=as_step(step), **kwargs)

    @on_main_process
    def finish(self) -> None:
        """Finish the run."""
        if self.run is not None:
            self.run.finish()
