"""The files of saved model weights: their names, and finding and reading them (one file, a folder, or shards).

A model's weights are ``model.safetensors`` (or ``pytorch_model.bin``), or shards ``model-00001-of-0000N.safetensors``
with an index ``model.safetensors.index.json`` (``{"metadata": {...}, "weight_map": {name: file}}``), the layout the
Hugging Face libraries read. :mod:`.saving` writes it; this module names the files and the metadata keys hasten adds
(the aliases of tied weights stored once, the id that binds the shards of one save) and reads them back.

Which file a folder or an index leads to follows Accelerate 1.15 (``pytorch_model.bin``, else
``model.safetensors``, else the folder's one ``*.index.json``; an index with or without its ``"weight_map"``
wrapper). Reading is hasten's: safetensors headers are checked against the file's size before anything is read,
tensors are read one by one, and ``.bin``/``.pt`` files only through ``torch.load(weights_only=True)``, which never
runs pickled code. Placing tensors by a device map is big-model inference's
(:func:`hasten.big_modeling.checkpoint_files.load_state_dict`).
"""

from __future__ import annotations

import json
import logging
import os
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from ...errors import CheckpointError
from .safetensors_io import SafetensorsHeader, read_header, read_tensors

logger = logging.getLogger(__name__)

MODEL_NAME = "pytorch_model"
SAFE_MODEL_NAME = "model"
WEIGHTS_NAME = f"{MODEL_NAME}.bin"
SAFE_WEIGHTS_NAME = f"{SAFE_MODEL_NAME}.safetensors"
WEIGHTS_INDEX_NAME = f"{WEIGHTS_NAME}.index.json"
SAFE_WEIGHTS_INDEX_NAME = f"{SAFE_WEIGHTS_NAME}.index.json"
WEIGHTS_PATTERN_NAME = "pytorch_model{suffix}.bin"
SAFE_WEIGHTS_PATTERN_NAME = "model{suffix}.safetensors"
ALIASES_KEY = "hasten_tied_weights"
SAVE_ID_KEY = "hasten_save_id"


class CheckpointLookupError(CheckpointError, ValueError):
    """No checkpoint where one was given, or a folder or index that does not say which files to load."""


class MissingShardError(CheckpointError, FileNotFoundError):
    """A file an index names is not there."""


class SafetensorsFormatError(CheckpointError, OSError):
    """A safetensors file whose metadata names no known framework."""


class ForeignFrameworkError(CheckpointError, ValueError):
    """A safetensors file saved for another framework (TensorFlow, Flax)."""


class RefusedPickleError(CheckpointError, pickle.UnpicklingError):
    """A torch file holds pickled objects that ``torch.load(weights_only=True)`` refuses (Accelerate's ``load`` raises
    the ``UnpicklingError`` itself)."""


def refused_pickle_error(path, error: Exception) -> CheckpointError:
    """The error for a torch file that ``torch.load(weights_only=True)`` rejected."""
    text = str(error).strip()
    reason = text.splitlines()[-1] if text else type(error).__name__
    return RefusedPickleError(
        f"Refused to load {path}: it contains pickled Python objects other than tensors, and loading it would run "
        f"the code they name ({reason}). hasten only loads such files with torch.load(weights_only=True). If you "
        "trust the file, convert it once: sd = torch.load(path, weights_only=False); "
        "safetensors.torch.save_file(sd, 'model.safetensors') and load the .safetensors file instead."
    )


def is_safetensors(path: Path) -> bool:
    """Whether ``path`` names a safetensors file (by its suffix, as Accelerate decides)."""
    return path.name.endswith(".safetensors")


def torch_file(path: Path) -> Mapping:
    """The state dict in a ``.bin``/``.pt`` file, read with ``torch.load(weights_only=True)`` on the CPU."""
    if not path.is_file():
        raise MissingShardError(f"The checkpoint file {path} does not exist.")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise refused_pickle_error(path, error) from None
    except (RuntimeError, EOFError, OSError, ValueError) as error:
        raise CheckpointError(
            f"{path} could not be read as a PyTorch checkpoint ({error}); it is truncated or damaged."
        ) from None
    if not isinstance(state, Mapping):
        raise CheckpointError(
            f"{path} holds a {type(state).__name__}, not a state dict (a dict of tensor names to tensors)."
        )
    return state


def safetensors_header(path: Path) -> SafetensorsHeader:
    """The checked header of a safetensors file whose metadata says it was saved from PyTorch (or says nothing)."""
    if not path.is_file():
        raise MissingShardError(f"The checkpoint file {path} does not exist.")
    header = read_header(path)
    if not header.metadata:
        logger.warning("The safetensors file %s has no metadata; reading it as a PyTorch checkpoint.", path)
        return header
    framework = header.metadata.get("format")
    if framework not in ("pt", "tf", "flax"):
        raise SafetensorsFormatError(
            f"{path} does not say which framework saved it (metadata format={framework!r}, expected 'pt'); "
            "save it again "
            "with save_pretrained or hasten.save_model."
        )
    if framework != "pt":
        raise ForeignFrameworkError(f"{path} was saved from {framework}; hasten loads PyTorch ('pt') checkpoints only.")
    return header


def aliases(header: SafetensorsHeader) -> dict[str, str]:
    """The names hasten's ``save_model`` left out because they share a tensor with another: ``{alias: saved name}``."""
    try:
        return dict(json.loads(header.metadata.get(ALIASES_KEY, "{}")))
    except json.JSONDecodeError:
        raise CheckpointError(
            f"{header.path} has damaged metadata ({ALIASES_KEY} is not JSON); save the model again."
        ) from None


def _read_on_device(path: Path, names: list[str], device) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device=str(device)) as handle:
        return {name: handle.get_tensor(name) for name in names}


def read_safetensors(header: SafetensorsHeader, groups: Mapping) -> dict[str, torch.Tensor]:
    """The tensors of ``groups`` (``{device: [names]}``): CPU tensors own their memory, the others are read on
    their device."""
    loaded: dict[str, torch.Tensor] = {}
    for device, names in groups.items():
        if device.type == "cpu":
            loaded.update(read_tensors(header, names))
        elif device.type == "meta":
            loaded.update(
                {n: torch.empty(header.entries[n].shape, dtype=header.entries[n].dtype, device="meta") for n in names}
            )
        else:
            loaded.update(_read_on_device(header.path, names, device))
    return loaded


@dataclass
class CheckpointFiles:
    """The files of one checkpoint, their safetensors headers, and the aliases hasten's saver recorded."""

    source: Path
    files: list[Path]
    headers: dict[Path, SafetensorsHeader]
    aliases: dict[str, str]


def _pick_in_folder(folder: Path) -> Path:
    for name in (WEIGHTS_NAME, SAFE_WEIGHTS_NAME):
        if (folder / name).is_file():
            return folder / name
    indexes = sorted(name for name in os.listdir(folder) if name.endswith(".index.json"))
    if len(indexes) == 1:
        return folder / indexes[0]
    if indexes:
        raise CheckpointLookupError(
            f"{folder} holds several index files ({', '.join(indexes)}); delete the ones that do not belong."
        )
    present = sorted(os.listdir(folder))
    shown = ", ".join(present[:10]) + (" ..." if len(present) > 10 else "") if present else "nothing"
    raise CheckpointLookupError(
        f"{folder} holds no model weights hasten recognises: expected {WEIGHTS_NAME}, {SAFE_WEIGHTS_NAME} or one "
        f"*.index.json file with its shards (found: {shown})."
    )


def _check_shards(path: Path, weight_map: Mapping, headers: Mapping[Path, SafetensorsHeader], save_id) -> None:
    """Shards of one save belong together: same save id (hasten's saver records one) and the tensors the index says."""
    for file, header in headers.items():
        shard_id = header.metadata.get(SAVE_ID_KEY)
        if save_id and shard_id and shard_id != save_id:
            raise CheckpointError(
                f"{file} belongs to a different save than {path} (an interrupted save left old and new shards "
                "together); save the model again."
            )
    for name, file_name in weight_map.items():
        header = headers.get(path.parent / file_name)
        if header is not None and name not in header.entries:
            raise CheckpointError(
                f"The index {path} says {name!r} is in {file_name}, but that file does not hold it; the checkpoint "
                "mixes files from different saves. Save or download it again."
            )


def _from_index(path: Path) -> CheckpointFiles:
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointLookupError(
            f"The index {path} is not valid JSON ({error}); it is truncated or damaged."
        ) from None
    metadata = index.get("metadata") if isinstance(index, dict) and isinstance(index.get("metadata"), dict) else {}
    weight_map = index["weight_map"] if isinstance(index, dict) and "weight_map" in index else index
    if not isinstance(weight_map, dict) or not all(isinstance(file, str) for file in weight_map.values()):
        raise CheckpointLookupError(
            f"The index {path} does not map weight names to shard files (a 'weight_map' object)."
        )
    files = [path.parent / name for name in sorted(set(weight_map.values()))]
    missing = [file.name for file in files if not file.is_file()]
    if missing:
        raise MissingShardError(
            f"The index {path} lists shard files that are missing: {', '.join(missing)}. The checkpoint is incomplete; "
            "copy or download the missing files, or save the model again."
        )
    headers = {file: safetensors_header(file) for file in files if is_safetensors(file)}
    _check_shards(path, weight_map, headers, metadata.get(SAVE_ID_KEY))
    found = dict(metadata.get(ALIASES_KEY) or {})
    for header in headers.values():
        found.update(aliases(header))
    return CheckpointFiles(path, files, headers, found)


def resolve_checkpoint(checkpoint) -> CheckpointFiles:
    """The files of a checkpoint given as a weights file, an index file (``*.json``) or a folder.

    Raises:
        CheckpointLookupError: (a ``ValueError``) nothing there, or a folder that says nothing about what to load.
        MissingShardError: (a ``FileNotFoundError``) a shard named by the index is missing.
    """
    path = Path(checkpoint)
    if path.is_dir():
        path = _pick_in_folder(path)
    elif not path.is_file():
        raise CheckpointLookupError(
            f"The checkpoint {path} does not exist: pass a weights file, the index of a sharded checkpoint, or a "
            "folder "
            "holding either."
        )
    if path.name.endswith(".json"):
        return _from_index(path)
    if is_safetensors(path):
        header = safetensors_header(path)
        return CheckpointFiles(path, [path], {path: header}, aliases(header))
    return CheckpointFiles(path, [path], {}, {})
