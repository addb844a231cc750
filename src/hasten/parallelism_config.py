"""``accelerate.parallelism_config``: :class:`ParallelismConfig`, re-exported from where hasten defines it."""

from .runtime.parallelism import ParallelismConfig

__all__ = ["ParallelismConfig"]
