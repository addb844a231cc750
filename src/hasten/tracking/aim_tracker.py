"""Aim (needs ``pip install aim``): runs stored in an Aim repository, by default the logging directory."""

from __future__ import annotations

import os

from ._common import as_step
from .base import GeneralTracker, on_main_process
from .values import tensors_to_numbers


class AimTracker(GeneralTracker):
    """Logs to an ``aim.Run`` in the repository ``logging_dir``, named after ``run_name``.

    Args:
        run_name: the project name given to ``init_trackers`` (the run's name).
        logging_dir: the Aim repository (``.`` when not given).
        **kwargs: passed to ``aim.Run`` (``experiment``, ``run_hash``, ``system_tracking_interval``, ...).
    """

    name = "aim"
    requires_logging_directory = True
    _package = "aim"

    def __init__(self, run_name: str, logging_dir: str | os.PathLike | None = ".", **kwargs):
        super().__init__()
        self.run_name = run_name
        self.aim_repo_path = logging_dir
        self.init_kwargs = kwargs
        self.writer = None

    @property
    def tracker(self):
        """The ``aim.Run`` (``None`` before ``start``)."""
        return self.writer

    @on_main_process
    def start(self) -> None:
        """Open the run in the repository."""
        from aim import Run

        self.writer = Run(
            repo=None if self.aim_repo_path is None else os.fspath(self.aim_repo_path), **self.init_kwargs
        )
        self.writer.name = self.run_name

    @on_main_process
    def store_init_configuration(self, values: dict) -> None:
        """Store ``values`` under the run's ``hparams``."""
        self.writer["hparams"] = values

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs) -> None:
        """Track each value under its name (``kwargs`` go to ``Run.track``, e.g. ``context``)."""
        for key, value in tensors_to_numbers(values).items():
            self.writer.track(value, name=key, step=as_step(step), **kwargs)

    @on_main_process
    def log_images(self, values: dict, step: int | None = None, kwargs: dict | None = None) -> None:
        """Track images: name -> image or ``(image, caption)``.

        Args:
            values: name -> array / PIL image, or a tuple of it and a caption.
            step: the step.
            kwargs: ``{"aim_image": {...}, "track": {...}}``, passed to ``aim.Image`` and ``Run.track``.
        """
        import aim

        options = kwargs or {}
        for key, value in values.items():
            image, caption = value if isinstance(value, tuple) else (value, "")
            self.writer.track(
                aim.Image(image, caption=caption, **options.get("aim_image", {})),
                name=key,
                step=as_step(step),
                **options.get("track", {}),
            )

    @on_main_process
    def finish(self) -> None:
        """Close the run."""
        if self.writer is not None:
            self.writer.close()
