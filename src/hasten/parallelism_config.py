"""``accelerate.parallelism_config``: :class:`ParallelismConfig`, re-exported from where hasten defines it."""

from .parallelism import ParallelismConfig

__all__ = ["ParallelismConfig"]
