"""Pipeline-parallel inference (Accelerate's ``accelerate.inference``): not supported by hasten.

The names exist so imports of ported scripts work; calling them raises
:class:`~hasten.errors.NotSupportedError` pointing to big-model inference instead.
"""

from __future__ import annotations

from .compat.unsupported import prepare_pippy
from .errors import NotSupportedError

_HINT = (
    "Pipeline-parallel inference is not supported by hasten; use load_checkpoint_and_dispatch(model, checkpoint, "
    "device_map='auto')."
)


def generate_device_map(model, num_processes=1, no_split_module_classes=None, max_memory=None):
    """Not supported (pipeline inference)."""
    raise NotSupportedError(_HINT)


def find_pippy_batch_size(args, kwargs):
    """Not supported (pipeline inference)."""
    raise NotSupportedError(_HINT)


def build_pipeline(model, split_points, args, kwargs, num_chunks):
    """Not supported (pipeline inference)."""
    raise NotSupportedError(_HINT)


def pippy_forward(forward, num_chunks, gather_output, *args, **kwargs):
    """Not supported (pipeline inference)."""
    raise NotSupportedError(_HINT)


__all__ = ["build_pipeline", "find_pippy_batch_size", "generate_device_map", "pippy_forward", "prepare_pippy"]
