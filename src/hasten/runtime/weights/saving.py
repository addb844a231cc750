"""Writing model weights in the layout the Hugging Face libraries read (``save_model_weights``, ``save``).

A model is written as ``model.safetensors``, or as shards ``model-00001-of-0000N.safetensors`` plus
``model.safetensors.index.json`` (``{"metadata": {"total_size": ...}, "weight_map": {name: file}}``).
Tensors that share memory (tied weights) are written once; the other names are recorded as aliases
in the files' metadata (:data:`~.files.ALIASES_KEY`) so that hasten's loaders tie them again. Every file is
written atomically, so an interrupted save never leaves a half-written file under a final name.

The engines' merges, ``Accelerator.save_model`` and ``hasten.save_model`` all write through here; reading is
:mod:`.files`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import uuid
from collections.abc import Mapping
from pathlib import Path

import torch

from ...errors import ConfigError
from ...settings.sizes import parse_size
from ..fileio import atomic_write
from .files import (
    ALIASES_KEY,
    MODEL_NAME,
    SAFE_MODEL_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_PATTERN_NAME,
    SAVE_ID_KEY,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_PATTERN_NAME,
)
from .safetensors_io import dedupe_tensors, write_safetensors


def _planned_bytes(tensor: torch.Tensor, safe: bool) -> int:
    """The bytes a tensor counts for when shards are planned, as Hugging Face's planner counts them: its storage's
    size (a view counts the whole storage it views), or its own size when safetensors copies it (not contiguous)."""
    if safe and not tensor.is_contiguous():
        return tensor.numel() * tensor.dtype.itemsize
    return tensor.untyped_storage().nbytes()


def _plan_shards(tensors: Mapping[str, torch.Tensor], limit: int, safe: bool) -> list[list[str]]:
    """The shards' tensor names, planned as Accelerate plans them (huggingface_hub's state-dict splitter), so that
    both write the same files: in the state dict's order, a tensor larger than ``limit`` gets a shard of its own at
    once, while the others fill the current shard until the next one would tip it over ``limit``."""
    shards: list[list[str]] = []
    current: list[str] = []
    size = 0
    for name, tensor in tensors.items():
        nbytes = _planned_bytes(tensor, safe)
        if nbytes > limit:
            shards.append([name])
            continue
        if size + nbytes > limit:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    if current or not shards:
        shards.append(current)
    return shards


def _shard_names(count: int, safe: bool) -> list[str]:
    pattern = SAFE_WEIGHTS_PATTERN_NAME if safe else WEIGHTS_PATTERN_NAME
    if count == 1:
        return [pattern.format(suffix="")]
    return [pattern.format(suffix=f"-{index:05d}-of-{count:05d}") for index in range(1, count + 1)]


def _write_safetensors_file(path: Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> None:
    with open(path, "wb") as handle:
        write_safetensors(handle, tensors, metadata)


def _owned(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor on the CPU, copied when it views a larger storage (torch.save would write all of it)."""
    tensor = tensor.detach().to("cpu")
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.dtype.itemsize or not tensor.is_contiguous():
        tensor = tensor.clone(memory_format=torch.contiguous_format)
    return tensor


def _write_shard(path: Path, tensors: dict, aliases: dict, safe: bool, save_id: str | None) -> None:
    if safe:
        metadata = {"format": "pt"}
        own = {alias: target for alias, target in aliases.items() if target in tensors}
        if own:
            metadata[ALIASES_KEY] = json.dumps(own, sort_keys=True)
        if save_id:
            metadata[SAVE_ID_KEY] = save_id
        atomic_write(path, lambda temporary: _write_safetensors_file(temporary, tensors, metadata))
        return
    payload = {name: _owned(tensor) for name, tensor in tensors.items()}
    for alias, target in aliases.items():
        if target in payload:
            payload[alias] = payload[target]
    atomic_write(path, lambda temporary: torch.save(payload, temporary))


def _remove_stale(directory: Path, safe: bool, keep: set[str]) -> None:
    stem, ext = (SAFE_MODEL_NAME, "safetensors") if safe else (MODEL_NAME, "bin")
    pattern = re.compile(
        rf"^(?:{stem}\.{ext}|{stem}\.{ext}\.index\.json|{stem}-\d{{5}}-of-\d{{5}}\.{ext}"
        rf"|\.{stem}(?:-\d{{5}}-of-\d{{5}})?\.{ext}(?:\.index\.json)?\.[0-9a-f]{{12}}\.tmp)$"
    )
    for entry in directory.iterdir():
        if entry.name not in keep and pattern.match(entry.name) and entry.is_file():
            entry.unlink()


def save_model_weights(
    state_dict: Mapping[str, torch.Tensor],
    save_directory: str | os.PathLike,
    max_shard_size: int | str = "10GB",
    safe_serialization: bool = True,
) -> list[Path]:
    """Write a state dict as one weights file or as shards plus an index, the layout Transformers reads.

    Tensors are written one shard at a time, each straight from its memory (a tensor on an
    accelerator is copied to the CPU on its own). Every file goes to a temporary name in the folder,
    is flushed to disk and renamed; weight files of an earlier save that this save does not replace
    (another shard count) are deleted only once all new files are complete.

    Args:
        state_dict: name -> tensor (a full, unsharded state dict).
        save_directory: the folder (created if needed).
        max_shard_size: largest shard, as bytes or a string like ``"5GB"``; a tensor larger than this
            gets a shard of its own.
        safe_serialization: write safetensors (``model*.safetensors``); with False, ``torch.save``
            files (``pytorch_model*.bin``), which only hasten's ``weights_only`` loader reads safely.

    Returns:
        The files written (shards, then the index when there is one).
    """
    directory = Path(save_directory)
    if directory.is_file():
        raise ConfigError(f"save_directory {directory} is a file; pass the folder to write the model's weights into.")
    directory.mkdir(parents=True, exist_ok=True)
    tensors, aliases = dedupe_tensors(state_dict)
    if safe_serialization:
        _log_shared(aliases)
    shards = _plan_shards(tensors, parse_size(max_shard_size), safe_serialization)
    names = _shard_names(len(shards), safe_serialization)
    save_id = uuid.uuid4().hex if len(shards) > 1 else None
    written = []
    for file_name, shard in zip(names, shards):
        part = {name: tensors[name] for name in shard}
        _write_shard(directory / file_name, part, aliases, safe_serialization, save_id)
        written.append(directory / file_name)
    if len(shards) > 1:
        index = {
            "metadata": {
                "total_size": sum(_planned_bytes(t, safe_serialization) for t in tensors.values()),
                SAVE_ID_KEY: save_id,
                ALIASES_KEY: aliases,
            },
            "weight_map": {name: file_name for file_name, shard in zip(names, shards) for name in shard},
        }
        text = json.dumps(index, indent=2, sort_keys=True) + "\n"
        index_path = directory / (SAFE_WEIGHTS_INDEX_NAME if safe_serialization else WEIGHTS_INDEX_NAME)
        written.append(atomic_write(index_path, lambda temporary: temporary.write_text(text, encoding="utf-8")))
    _remove_stale(directory, safe_serialization, {path.name for path in written})
    return written


def _log_shared(aliases: dict[str, str]) -> None:
    """Log, as Accelerate does, the names of tensors a safetensors file stores once for several names."""
    if aliases:
        logging.getLogger(__name__).warning(
            f"Removed shared tensor {set(aliases)} while saving: each shares memory with another tensor "
            f"({', '.join(f'{a} -> {t}' for a, t in sorted(aliases.items()))}), which is stored once; hasten's loaders "
            "tie them again, other safetensors readers see only the names kept."
        )


def _should_write(save_on_each_node: bool) -> bool:
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return True
    from ...state import PartialState

    state = PartialState()
    return state.is_local_main_process if save_on_each_node else state.is_main_process


def save(obj, f, save_on_each_node: bool = False, safe_serialization: bool = False) -> None:
    """Save ``obj`` to ``f`` from one process (the main one, or one per machine with ``save_on_each_node``).

    With ``safe_serialization``, ``obj`` must be a dict of tensors and is written as safetensors
    (tensors sharing memory are stored once and tied again by :func:`load`); otherwise it is written
    with ``torch.save``. A path is written atomically.

    Args:
        obj: what to save.
        f: a path, or a binary file object (``torch.save`` only).
        save_on_each_node: write once per machine instead of once in total.
        safe_serialization: write safetensors.
    """
    if not _should_write(save_on_each_node):
        return
    if not safe_serialization:
        if isinstance(f, (str, os.PathLike)):
            atomic_write(f, lambda temporary: torch.save(obj, temporary))
        else:
            torch.save(obj, f)
        return
    if not isinstance(obj, Mapping) or not all(isinstance(value, torch.Tensor) for value in obj.values()):
        raise ConfigError(
            f"safe_serialization=True saves a dict of tensors, got {type(obj).__name__}. Save other objects with "
            "safe_serialization=False (torch.save)."
        )
    if not isinstance(f, (str, os.PathLike)):
        raise ConfigError("safe_serialization=True needs a file path to write to, not a file object.")
    tensors, aliases = dedupe_tensors(obj)
    _log_shared(aliases)
    metadata = {"format": "pt", **({ALIASES_KEY: json.dumps(aliases, sort_keys=True)} if aliases else {})}
    atomic_write(f, lambda temporary: _write_safetensors_file(temporary, tensors, metadata))
