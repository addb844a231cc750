"""The ``Accelerator``'s dataloader settings, mixed into the facade: read-through properties of its
``DataLoaderConfiguration``, and ``join_uneven_inputs`` (which overrides them for a block)."""

from __future__ import annotations

import contextlib
import warnings

from .loaders import DataLoaderShard, even_batches_overridden


class DataLoaderSettings:
    """``split_batches``, ``even_batches`` and the other :class:`~hasten.DataLoaderConfiguration` values of
    :class:`~hasten.Accelerator`."""

    @contextlib.contextmanager
    def join_uneven_inputs(self, joinables, even_batches: bool | None = None):
        """Context manager for training on uneven inputs with ``torch.distributed.algorithms.Join`` (DDP).

        With ``even_batches=False`` (here or in the dataloader configuration) a rank may run out of batches
        first; ``Join`` shadows its collectives so the others finish. ``even_batches`` overrides the
        prepared map-style dataloaders' setting for the block. Under other engines (FSDP, DeepSpeed) it
        warns and has no effect, as in Accelerate.
        """
        joins = self._strategy.joins_uneven_inputs
        if not joins:
            if joins is not None:
                kind = getattr(self.state.distributed_type, "value", self.state.distributed_type)
                warnings.warn(
                    f"Joining uneven inputs is only supported for multi-GPU training (DDP, here {kind}); "
                    "join_uneven_inputs has no effect. Keep even_batches=True under this engine.",
                    stacklevel=3,
                )
            yield None
            return
        from torch.distributed.algorithms import Join

        if even_batches is not None and any(
            not isinstance(dl, DataLoaderShard) or dl.even_batches is None for dl in self._dataloaders
        ):
            warnings.warn(
                "Overriding even_batches is only supported for map-style datasets, yet some prepared dataloaders are "
                "iterable: their setting stays as it is.",
                stacklevel=3,
            )
        uneven = not (self.even_batches if even_batches is None else even_batches)
        with (
            even_batches_overridden(self._dataloaders, even_batches),
            Join(joinables, enable=uneven, throw_on_early_termination=False) as join,
        ):
            yield join

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
        """Whether a ``RandomSampler`` becomes a :class:`~hasten.data_loader.SeedableRandomSampler` (order from
        ``data_seed``, else the global seed, plus the epoch), as in Accelerate."""
        return self.dataloader_config.use_seedable_sampler

    @property
    def non_blocking(self) -> bool:
        """Whether batches are copied to the device asynchronously."""
        return self.dataloader_config.non_blocking

    @property
    def use_stateful_dataloader(self) -> bool:
        """Whether ``load_state`` moves prepared dataloaders to their saved position (``DataLoaderConfiguration``)."""
        return self.dataloader_config.use_stateful_dataloader
