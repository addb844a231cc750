"""Trackio (needs ``pip install trackio``): a local-first tracker with the wandb-like ``init``/``log``/``finish``
API."""

from __future__ import annotations

from .base import on_main_process
from .project_run import ProjectRunTracker


class TrackioTracker(ProjectRunTracker):
    """Logs to a run made with ``trackio.init(project=run_name, **kwargs)``.

    Note:
        One run is made, by the main process (see :class:`~hasten.tracking.WandBTracker`).

    Args:
        run_name: the project name given to ``init_trackers``.
        **kwargs: passed to ``trackio.init`` (``name``, ``space_id``, ``config``, ...).
    """

    name = "trackio"
    _package = "trackio"

    @on_main_process
    def store_init_configuration(self, values: dict) -> None:
        """Add ``values`` to the run's config."""
        import trackio

        trackio.config.update(values, allow_val_change=True)
