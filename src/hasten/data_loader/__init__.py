"""Prepared dataloaders: sharding between processes, dispatching, resuming and metric gathering.

``hasten.data_loader`` keeps the public import path of ``accelerate.data_loader``.
"""

from .dispatcher import DataLoaderDispatcher
from .loaders import DataLoaderShard, DataLoaderStateMixin
from .metrics import gather_for_metrics
from .prepare import prepare_data_loader
from .sharding import (
    BatchSamplerShard,
    FinalRound,
    IterableDatasetShard,
    SeedableRandomSampler,
    SkipBatchSampler,
    get_sampler,
)
from .skipping import SkipDataLoader, skip_first_batches

__all__ = [
    "BatchSamplerShard",
    "DataLoaderDispatcher",
    "DataLoaderShard",
    "DataLoaderStateMixin",
    "FinalRound",
    "IterableDatasetShard",
    "SeedableRandomSampler",
    "SkipBatchSampler",
    "SkipDataLoader",
    "gather_for_metrics",
    "get_sampler",
    "prepare_data_loader",
    "skip_first_batches",
]
