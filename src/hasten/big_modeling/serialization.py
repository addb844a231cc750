"""Accelerate's ``save``/``load`` and the weight-saving names big-model users import from here.

Writing weights (``save_model_weights``, ``save``: sharded, tied weights once, atomic) is the weight-file layer's
(:mod:`hasten.runtime.weights.saving`), which the engines and checkpoints use too; it is re-exported here with the
loaders (:func:`load_checkpoint_in_model`, :func:`load_state_dict`) and :func:`load`, which reads what :func:`save`
wrote.
"""

from __future__ import annotations

import functools
import io
import os
import pickle

import torch

from ..errors import ConfigError
from ..runtime.fileio import atomic_write
from ..runtime.weights.safetensors_io import dedupe_tensors, read_header
from ..runtime.weights.saving import save, save_model_weights
from ..settings.sizes import parse_size
from .checkpoint_files import (
    MODEL_NAME,
    SAFE_MODEL_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    SAFE_WEIGHTS_PATTERN_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    WEIGHTS_PATTERN_NAME,
    load_state_dict,
    refused_pickle_error,
)
from .checkpoint_loading import load_checkpoint_in_model

__all__ = [
    "MODEL_NAME",
    "SAFE_MODEL_NAME",
    "SAFE_WEIGHTS_INDEX_NAME",
    "SAFE_WEIGHTS_NAME",
    "SAFE_WEIGHTS_PATTERN_NAME",
    "WEIGHTS_INDEX_NAME",
    "WEIGHTS_NAME",
    "WEIGHTS_PATTERN_NAME",
    "atomic_write",
    "dedupe_tensors",
    "load",
    "load_checkpoint_in_model",
    "load_state_dict",
    "parse_size",
    "save",
    "save_model_weights",
    "verify_safetensors_file",
]


def verify_safetensors_file(path: str | os.PathLike):
    """Check a safetensors file's header against its size without reading the tensors.

    Returns:
        The parsed header (:class:`hasten.runtime.weights.safetensors_io.SafetensorsHeader`).

    Raises:
        CheckpointError: the file is missing, truncated or damaged; the message names it.
    """
    return read_header(path)


@functools.cache
def _safe_numpy_globals() -> list:
    """What numpy arrays (e.g. RNG states) need to load under ``weights_only=True``: array reconstruction and
    dtypes, no code (Accelerate's ``TORCH_SAFE_GLOBALS``)."""
    import codecs

    import numpy as np

    multiarray = getattr(np, "_core", None) or np.core
    return [multiarray.multiarray._reconstruct, np.ndarray, codecs.encode, np.dtype, np.dtypes.UInt32DType]


def __getattr__(name: str):
    if name == "TORCH_SAFE_GLOBALS":
        return _safe_numpy_globals()
    raise AttributeError(f"module 'hasten.big_modeling.serialization' has no attribute {name!r}")


def load(f, map_location=None, **kwargs):
    """Load what :func:`save` wrote: safetensors by file extension, otherwise ``torch.load``.

    ``torch.load`` runs with ``weights_only=True`` unless the caller passes ``weights_only=False``
    explicitly, so no pickled code runs by default.

    Args:
        f: a path or a binary file object.
        map_location: where to put the tensors (a device for safetensors files).
        **kwargs: passed to ``torch.load``.

    Raises:
        CheckpointError: the file is damaged, or holds pickled objects that ``weights_only`` refuses.
    """
    if isinstance(f, (str, os.PathLike)) and str(f).endswith(".safetensors"):
        if map_location is not None and not isinstance(map_location, (str, int, torch.device)):
            raise ConfigError("map_location for a safetensors file must be a device, not a mapping or a function.")
        return load_state_dict(f, device_map=None if map_location is None else {"": map_location})
    kwargs.setdefault("weights_only", True)
    try:
        with torch.serialization.safe_globals(_safe_numpy_globals()):
            return torch.load(f, map_location=map_location, **kwargs)
    except pickle.UnpicklingError as error:
        if kwargs["weights_only"]:
            raise refused_pickle_error(f if not isinstance(f, io.IOBase) else "the file object", error) from None
        raise
