"""Configuration objects passed to ``Accelerator`` (kwargs handlers and plugins), one file per concern."""

from .fp8 import AORecipeKwargs, FP8RecipeKwargs
from .kwargs import (
    AutocastKwargs,
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
    ProfileKwargs,
)
from .training import DataLoaderConfiguration, GradientAccumulationPlugin, ProjectConfiguration

__all__ = [
    "AORecipeKwargs",
    "AutocastKwargs",
    "DataLoaderConfiguration",
    "DistributedDataParallelKwargs",
    "FP8RecipeKwargs",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "InitProcessGroupKwargs",
    "KwargsHandler",
    "ProfileKwargs",
    "ProjectConfiguration",
]
