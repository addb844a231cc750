"""Training configuration objects: project folders, dataloader behaviour, gradient accumulation."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from .. import environment
from ..errors import ConfigError
from ..settings.deepspeed import GRADIENT_ACCUMULATION_STEPS
from ..settings.sizes import parse_size
from .kwargs import KwargsHandler


@dataclass
class ProjectConfiguration(KwargsHandler):
    """Where a project writes logs and checkpoints.

    Args:
        project_dir: base folder of the project.
        logging_dir: folder of tracker logs (defaults to ``project_dir``).
        automatic_checkpoint_naming: ``save_state()`` writes ``project_dir/checkpoints/checkpoint_<i>``.
        total_limit: keep at most this many automatic checkpoints (oldest deleted once a new one is complete).
        iteration: number of the next automatic checkpoint.
        save_on_each_node: write checkpoints on every machine (no shared filesystem).
        async_save: ``save_state()`` copies the state and writes the files in the background by default
            (``save_state(async_save=...)`` overrides it; see docs/checkpointing.md).
        async_staging_limit: the most host memory an asynchronous save copies the state into (bytes, or a
            size such as ``"2GB"``); None stages everything (as much memory as the parameters and optimizer
            state). Files that do not fit are written from the live tensors, and the next optimizer step
            waits for them.
    """

    project_dir: str | None = None
    logging_dir: str | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0
    save_on_each_node: bool = False
    async_save: bool = False
    async_staging_limit: int | str | None = None

    def __post_init__(self):
        if self.logging_dir is None:
            self.logging_dir = self.project_dir
        if self.async_staging_limit is not None:
            self.async_staging_limit = parse_size(self.async_staging_limit)
        if self.total_limit is not None and (not isinstance(self.total_limit, int) or self.total_limit < 1):
            raise ConfigError(
                f"ProjectConfiguration(total_limit={self.total_limit!r}): give a positive integer or None."
            )

    def set_directories(self, project_dir: str | os.PathLike | None = None) -> None:
        """Set ``project_dir`` and, when it was unset, ``logging_dir``."""
        self.project_dir = None if project_dir is None else os.fspath(project_dir)
        if self.logging_dir is None:
            self.logging_dir = self.project_dir


@dataclass
class DataLoaderConfiguration(KwargsHandler):
    """How ``prepare`` shards and feeds dataloaders.

    Args:
        split_batches: the loader's batch size is the global batch; each of N processes gets 1/N of it.
            Otherwise each process gets a whole batch and the global batch is N times larger.
        dispatch_batches: the main process reads the data and sends each process its share
            (default: True for ``IterableDataset``, False otherwise).
        even_batches: complete the last global batch with samples from the start of the dataset so every
            process gets the same number of full batches (``gather_for_metrics`` drops the extras).
            With False nothing is repeated: the leftover batches go to the first processes (with
            ``split_batches``, the last batch is cut in pieces of the usual size), so a process may get one
            batch fewer, as in Accelerate.
        use_seedable_sampler: shuffle with a sampler seeded by ``data_seed`` (else the global seed) + epoch.
        data_seed: seed of the seedable sampler.
        non_blocking: copy batches to the device asynchronously (needs ``pin_memory=True``).
        use_stateful_dataloader: ``load_state`` also moves prepared dataloaders to their saved position in the
            epoch (every prepared loader records it). Off by default, as in Accelerate: ``load_state``
            restores the epoch and the random state it started from, and the loop skips the batches it
            already trained on.
    """

    split_batches: bool = False
    dispatch_batches: bool | None = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: int | None = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False


@dataclass
class GradientAccumulationPlugin(KwargsHandler):
    """Gradient accumulation settings.

    Args:
        num_steps: micro-batches per optimizer step.
        adjust_scheduler: kept for compatibility with Accelerate, which reads the default back as False
            (``GradientState`` keeps only non-default fields), so the scheduler steps once per real
            optimizer step either way.
        sync_with_dataloader: the last batch of a dataloader always synchronises and steps.
        sync_each_batch: reduce gradients on every micro-batch (less memory, more communication).
    """

    num_steps: int | None = None
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False

    def __post_init__(self):
        if self.num_steps is not None and (not isinstance(self.num_steps, int) or self.num_steps < 1):
            raise ConfigError(f"GradientAccumulationPlugin(num_steps={self.num_steps!r}): give a positive integer.")


def resolve_accumulation(steps: int, plugin=None):
    """The ``GradientAccumulationPlugin`` of ``Accelerator(gradient_accumulation_steps=steps,
    gradient_accumulation_plugin=plugin)``: a new one, which the Accelerator owns (the engine may settle its steps,
    ``accelerator.gradient_accumulation_steps = n`` changes them; the user's plugin is left as given).

    ``steps`` of 1 reads ``HASTEN_GRADIENT_ACCUMULATION_STEPS`` (which ``hasten launch`` sets from its flag or the
    config file); giving both ``steps`` and ``plugin`` is an error.
    """
    if plugin is not None:
        if steps != 1:
            raise ConfigError(
                f"Pass either gradient_accumulation_steps={steps} or a gradient_accumulation_plugin, not both: "
                "set num_steps in the plugin."
            )
        return dataclasses.replace(plugin)
    if steps == 1:
        launched = environment.read_setting(GRADIENT_ACCUMULATION_STEPS)
        steps = 1 if launched is None else launched
    if not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"gradient_accumulation_steps={steps!r}: give a positive integer.")
    return GradientAccumulationPlugin(num_steps=steps)
