"""Public names of Accelerate that hasten does not support: they exist so imports work, and say so clearly when used."""

from __future__ import annotations

from .errors import NotSupportedError
from .parallelism import ParallelismConfig

__all__ = ["ParallelismConfig", "is_rich_available", "prepare_pippy"]


def prepare_pippy(model, split_points="auto", no_split_module_classes=None, example_args=(), example_kwargs=None, num_chunks=None, gather_output=False):
    """Pipeline-parallel inference (Accelerate's ``prepare_pippy``) is not supported by hasten."""
    raise NotSupportedError(
        "prepare_pippy (pipeline-parallel inference) is not supported by hasten. For a model larger than one device, "
        "use big-model inference: load_checkpoint_and_dispatch(model, checkpoint, device_map='auto')."
    )


def is_rich_available() -> bool:
    """Whether the ``rich`` package is installed (hasten does not install rich tracebacks)."""
    import importlib.util

    return importlib.util.find_spec("rich") is not None
