"""Reading one weights file onto the devices of a device map (``load_state_dict``), and the names of the weight files.

Finding, checking and reading a checkpoint's files is the weight-file layer's
(:mod:`hasten.runtime.weights.files`), which the training side shares; this module adds what big-model inference needs
on top, placing each tensor where a device map says, and keeps Accelerate's import paths of the file names.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from ..runtime.weights.files import (  # noqa: F401 (the names big_modeling and Accelerate's paths take from here)
    ALIASES_KEY,
    MODEL_NAME,
    SAFE_MODEL_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    SAFE_WEIGHTS_PATTERN_NAME,
    SAVE_ID_KEY,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    WEIGHTS_PATTERN_NAME,
    CheckpointFiles,
    CheckpointLookupError,
    ForeignFrameworkError,
    MissingShardError,
    RefusedPickleError,
    SafetensorsFormatError,
    aliases,
    is_safetensors,
    read_safetensors,
    refused_pickle_error,
    resolve_checkpoint,
    safetensors_header,
    torch_file,
)
from .placement import device_for
from .tensors import as_device

_CPU = torch.device("cpu")


def load_state_dict(checkpoint_file, device_map: Mapping | None = None) -> dict[str, torch.Tensor]:
    """Load one weights file (safetensors or ``.bin``/``.pt``) into a dict of tensors.

    Args:
        checkpoint_file: the file.
        device_map: for a safetensors file, where to read each tensor (longest-prefix match); tensors mapped to
            ``"disk"`` or to nothing are read on the CPU. ``.bin`` files are always read on the CPU.

    Raises:
        CheckpointError: the file is missing, truncated or damaged, was saved by another framework, or holds
            pickled objects.
    """
    path = Path(checkpoint_file)
    if not is_safetensors(path):
        return dict(torch_file(path))
    header = safetensors_header(path)
    devices = {} if device_map is None else {name: device for name, device in device_map.items() if device != "disk"}
    groups: dict = {}
    for name in header.entries:
        found = device_for(name, devices)
        groups.setdefault(_CPU if found is None else as_device(found), []).append(name)
    loaded = read_safetensors(header, groups)
    result = {name: loaded[name] for name in header.entries}
    for alias, target in aliases(header).items():
        if target in result:
            result[alias] = result[target]
    return result
