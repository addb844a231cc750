"""Weights & Biases (needs ``pip install wandb``; ``WANDB_MODE=offline`` writes runs locally for ``wandb sync``)."""

from __future__ import annotations

from ._common import as_step
from .base import on_main_process
from .project_run import ProjectRunTracker
from .values import sanitize_config


class WandBTracker(ProjectRunTracker):
    """Logs to a Weights & Biases run created with ``wandb.init(project=run_name, **kwargs)``.

    Offline mode works as wandb documents it: set ``WANDB_MODE=offline`` or pass
    ``init_kwargs={"wandb": {"mode": "offline"}}``; the run is written under ``./wandb`` (or
    ``dir=...`` / ``WANDB_DIR``) and can be uploaded later with ``wandb sync``.

    Note:
        One run is made, by the main process. Accelerate declares this class with
        ``main_process_only = False`` yet its ``Accelerator`` only starts trackers on the main process,
        so it also makes one run; hasten states that directly. For one run per process, subclass it
        with ``main_process_only = False`` and pass ``group=...`` in ``init_kwargs``.

    Args:
        run_name: the project name given to ``init_trackers`` (wandb's ``project``).
        **kwargs: passed to ``wandb.init`` (``entity``, ``name``, ``tags``, ``mode``, ``dir``, ``group``, ...).
    """

    name = "wandb"
    _package = "wandb"

    @on_main_process
    def store_init_configuration(self, values: dict) -> None:
        """Store ``values`` in the run's config (later calls may change earlier values)."""
        self.run.config.update(sanitize_config(values), allow_val_change=True)

    @on_main_process
    def log_images(self, values: dict, step: int | None = None, **kwargs) -> None:
        """Log lists of images: name -> list of arrays / PIL images / tensors (each wrapped in ``wandb.Image``)."""
        import wandb

        images = {key: [wandb.Image(image) for image in batch] for key, batch in values.items()}
        self.run.log(images, step=as_step(step), **kwargs)

    @on_main_process
    def log_table(
        self, table_name: str, columns=None, data=None, dataframe=None, step: int | None = None, **kwargs
    ) -> None:
        """Log a ``wandb.Table`` built from ``columns`` + ``data`` (list of rows) or a pandas ``dataframe``."""
        import wandb

        table = wandb.Table(columns=columns, data=data, dataframe=dataframe)
        self.run.log({table_name: table}, step=as_step(step), **kwargs)
