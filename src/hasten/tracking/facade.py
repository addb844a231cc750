"""The ``Accelerator``'s tracking methods, mixed into the facade: they drive its
:class:`~hasten.tracking.TrackerHub`."""

from __future__ import annotations


class TrackingMethods:
    """``init_trackers``, ``log``, ``get_tracker`` and the tracker properties of :class:`~hasten.Accelerator`."""

    @property
    def trackers(self) -> list:
        """The experiment trackers running on this process."""
        return self._tracker_hub.trackers

    @property
    def log_with(self) -> list:
        """The trackers requested with ``log_with``."""
        return self._tracker_hub.log_with

    @property
    def project_dir(self) -> str | None:
        """The project folder (logs and automatic checkpoints)."""
        return self.project_configuration.project_dir

    @property
    def logging_dir(self) -> str | None:
        """The folder of tracker logs."""
        return self.project_configuration.logging_dir

    def init_trackers(self, project_name: str, config: dict | None = None, init_kwargs: dict | None = None) -> None:
        """Start the trackers of ``log_with`` for ``project_name`` and record ``config`` (hyperparameters).

        Call it on every process; only the main process writes (unless a tracker says otherwise).
        ``init_kwargs`` maps a tracker name to keyword arguments for it, e.g. ``{"wandb": {"entity": "me"}}``.
        """
        self._tracker_hub.init(project_name, config=config, init_kwargs=init_kwargs)

    def log(self, values: dict, step: int | None = None, log_kwargs: dict | None = None) -> None:
        """Log a dict of scalars (tensors are converted) to every tracker, at ``step``."""
        self._tracker_hub.log(values, step=step, log_kwargs=log_kwargs)

    def get_tracker(self, name: str, unwrap: bool = False):
        """The tracker called ``name`` (its underlying run object with ``unwrap``); a no-op tracker on other ranks."""
        return self._tracker_hub.get(name, unwrap=unwrap)
