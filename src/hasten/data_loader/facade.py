"""The ``Accelerator``'s dataloader settings, mixed into the facade: read-through properties of its ``DataLoaderConfiguration``."""

from __future__ import annotations


class DataLoaderSettings:
    """``split_batches``, ``even_batches`` and the other :class:`~hasten.DataLoaderConfiguration` values of :class:`~hasten.Accelerator`."""

    @property
    def split_batches(self) -> bool:
        """Whether each global batch is split between processes."""
        return self.dataloader_config.split_batches

    @property
    def dispatch_batches(self) -> bool | None:
        """Whether the main process reads the data and dispatches it."""
        return self.dataloader_config.dispatch_batches

    @property
    def even_batches(self) -> bool:
        """Whether the last round is completed with samples from the start (default True)."""
        return self.dataloader_config.even_batches

    @even_batches.setter
    def even_batches(self, value: bool) -> None:
        self.dataloader_config.even_batches = value

    @property
    def use_seedable_sampler(self) -> bool:
        """Always effectively True in hasten: shuffling is seeded identically on every process."""
        return self.dataloader_config.use_seedable_sampler

    @property
    def non_blocking(self) -> bool:
        """Whether batches are copied to the device asynchronously."""
        return self.dataloader_config.non_blocking

    @property
    def use_stateful_dataloader(self) -> bool:
        """Whether ``load_state`` moves prepared dataloaders to their saved position (``DataLoaderConfiguration``)."""
        return self.dataloader_config.use_stateful_dataloader
