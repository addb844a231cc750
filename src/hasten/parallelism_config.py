"""``accelerate.parallelism_config``: :class:`ParallelismConfig`, re-exported from where hasten defines it."""

from .unsupported import ParallelismConfig

__all__ = ["ParallelismConfig"]
