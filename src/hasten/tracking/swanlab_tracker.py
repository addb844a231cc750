"""SwanLab (needs ``pip install swanlab``): runs made with ``swanlab.init``."""

from __future__ import annotations

from ._common import as_step
from .base import on_main_process
from .project_run import ProjectRunTracker


class SwanLabTracker(ProjectRunTracker):
    """Logs to a run made with ``swanlab.init(project=run_name, **kwargs)``.

    Note:
        One run is made, by the main process (see :class:`~hasten.tracking.WandBTracker`).

    Args:
        run_name: the project name given to ``init_trackers``.
        **kwargs: passed to ``swanlab.init`` (``experiment_name``, ``mode``, ``logdir``, ...).
    """

    name = "swanlab"
    _package = "swanlab"

    @on_main_process
    def store_init_configuration(self, values: dict) -> None:
        """Add ``values`` to the run's config."""
        import swanlab

        swanlab.config.update(values, allow_val_change=True)

    @on_main_process
    def log_images(self, values: dict, step: int | None = None, **kwargs) -> None:
        """Log lists of images: name -> list of arrays / PIL images (each wrapped in ``swanlab.Image``)."""
        import swanlab

        self.run.log(
            {key: [swanlab.Image(image) for image in batch] for key, batch in values.items()},
            step=as_step(step),
            **kwargs,
        )
