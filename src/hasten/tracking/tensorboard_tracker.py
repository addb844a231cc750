"""TensorBoard through ``torch.utils.tensorboard`` (needs the ``tensorboard`` package: ``pip install
'hasten[tracking]'``)."""

from __future__ import annotations

import os
from collections.abc import Mapping

import yaml

from ._common import SkipReporter, as_step, is_number
from .base import GeneralTracker, on_main_process
from .values import flatten, sanitize_config, tensors_to_numbers


class TensorBoardTracker(GeneralTracker):
    """Writes TensorBoard event files under ``logging_dir/run_name``.

    Numbers become scalars, strings text, and a dict of numbers one chart with a line per key
    (``add_scalars``, which TensorBoard stores in one sub-folder per key). The writer is flushed
    after every ``log`` call, so a crash loses nothing that was logged.

    Args:
        run_name: the project name given to ``init_trackers``; the folder of this run.
        logging_dir: the folder that holds the runs (``ProjectConfiguration.logging_dir``).
        **kwargs: passed to ``torch.utils.tensorboard.SummaryWriter`` (``flush_secs``, ``max_queue``, ...).
    """

    name = "tensorboard"
    requires_logging_directory = True
    _package = "tensorboard"
    _extra = "tracking"

    def __init__(self, run_name: str, logging_dir: str | os.PathLike, **kwargs):
        super().__init__()
        self.run_name = run_name
        self.logging_dir = os.path.join(os.fspath(logging_dir), run_name)
        self.init_kwargs = kwargs
        self.writer = None
        self._skips = SkipReporter(self.name, "a number, a string or a dict of numbers")

    @property
    def tracker(self):
        """The ``SummaryWriter`` (``None`` before ``start``)."""
        return self.writer

    @on_main_process
    def start(self) -> None:
        """Open the ``SummaryWriter`` on ``logging_dir/run_name``."""
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(self.logging_dir, **self.init_kwargs)

    @on_main_process
    def store_init_configuration(self, values: dict) -> None:
        """Record ``values`` in the HParams dashboard of this run and in ``hparams.yml`` beside the events.

        Nested dicts are flattened with ``/`` in the dashboard and lists shown as JSON text.
        """
        from torch.utils.tensorboard.summary import hparams

        config = sanitize_config(values)
        flat = {key: value for key, value in flatten(config).items() if value is not None}
        # Written into this run's own event file (add_hparams would open a second run in a sub-folder).
        for summary in hparams(flat, {}, {}):
            self.writer.file_writer.add_summary(summary)
        self.writer.flush()
        with open(os.path.join(self.logging_dir, "hparams.yml"), "w", encoding="utf-8") as handle:
            yaml.safe_dump(config, handle, sort_keys=True)

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs) -> None:
        """Write scalars, texts and scalar groups for ``step``, then flush.

        Args:
            values: name -> number, string or dict of numbers (one-element tensors are converted).
            step: the global step.
            **kwargs: passed to ``add_scalar`` / ``add_text`` / ``add_scalars`` (e.g. ``walltime``).
        """
        step = as_step(step)
        for key, value in tensors_to_numbers(values).items():
            if is_number(value):
                self.writer.add_scalar(key, float(value), global_step=step, **kwargs)
            elif isinstance(value, str):
                self.writer.add_text(key, value, global_step=step, **kwargs)
            elif isinstance(value, Mapping) and value and all(is_number(item) for item in value.values()):
                group = {str(name): float(item) for name, item in value.items()}
                self.writer.add_scalars(key, group, global_step=step, **kwargs)
            else:
                self._skips.skip(key, value)
        self.writer.flush()

    @on_main_process
    def log_images(self, values: dict, step: int | None = None, **kwargs) -> None:
        """Write image batches: name -> tensor/array of shape ``(N, C, H, W)`` (see ``add_images``)."""
        for key, images in values.items():
            self.writer.add_images(key, images, global_step=step, **kwargs)
        self.writer.flush()

    @on_main_process
    def finish(self) -> None:
        """Flush and close the writer."""
        if self.writer is not None:
            self.writer.close()
