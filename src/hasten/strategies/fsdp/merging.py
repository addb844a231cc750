"""Merging an FSDP sharded model checkpoint offline: its DCP shards read into one full state dict in a single
process (:func:`read_sharded_model`) and written as one model file (:func:`merge_fsdp_weights`, behind
``hasten merge-weights``).

The shards' ``.metadata`` is read with :mod:`.checkpoint`'s safe reader and their items by :mod:`.shard_files`
(layouts only, or ``torch.load(weights_only=True)``), so merging never runs pickled code. Accelerate's
``accelerate.utils.merge_fsdp_weights`` and the FSDP engine's registration point here.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from ...errors import CheckpointError
from .checkpoint import _METADATA, MODEL_SHARDS, _is_main, _reader
from .shard_files import read_full_tensors


def _model_shards_folder(checkpoint_dir: Path) -> Path:
    if (checkpoint_dir / _METADATA).is_file():
        return checkpoint_dir
    first = checkpoint_dir / MODEL_SHARDS.format(0)
    if (first / _METADATA).is_file():
        return first
    raise CheckpointError(
        f"{checkpoint_dir} holds no FSDP sharded model: expected a folder written by torch.distributed.checkpoint "
        f"(with a {_METADATA} file), such as <checkpoint>/{MODEL_SHARDS.format(0)}, or a checkpoint folder containing "
        f"{MODEL_SHARDS.format(0)}. Save with state_dict_type='SHARDED_STATE_DICT'."
    )


def _model_entries(folder: Path) -> dict:
    entries = _reader(folder).read_metadata().state_dict_metadata
    if any(key.startswith("optimizer.") for key in entries):
        raise CheckpointError(
            f"{folder} holds optimizer state, not model weights; pass the {MODEL_SHARDS.format('<i>')} folder instead."
        )
    return entries


def read_sharded_model(checkpoint_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Read a sharded model checkpoint into one full state dict, in this process alone (no process group needed).

    ``checkpoint_dir`` is the shards folder or a checkpoint folder holding ``pytorch_model_fsdp_0``.
    """
    folder = _model_shards_folder(Path(checkpoint_dir))
    _model_entries(folder)
    state = read_full_tensors(folder)
    prefix = "model."
    if state and all(key.startswith(prefix) for key in state):
        state = {key[len(prefix) :]: value for key, value in state.items()}
    return state


def merge_fsdp_weights(
    checkpoint_dir: str | os.PathLike,
    output_path: str | os.PathLike,
    safe_serialization: bool = True,
    remove_checkpoint_dir: bool = False,
):
    """Merge an FSDP sharded model checkpoint into one model file (``model.safetensors``, sharded with an index when
    large).

    Args:
        checkpoint_dir: the shards folder (``<checkpoint>/pytorch_model_fsdp_0``), or a checkpoint folder
            written by ``save_state`` that holds one.
        output_path: the folder to write the weights into (created if needed).
        safe_serialization: write safetensors (default); False writes ``pytorch_model.bin``.
        remove_checkpoint_dir: delete ``checkpoint_dir`` once the merged weights are written.

    Returns:
        The files written (on the main process; an empty list on the others).

    Under a process group, call it on every process: all check the checkpoint, the main process merges
    and the others wait for it.
    """
    from ...runtime.weights.saving import save_model_weights

    _model_entries(_model_shards_folder(Path(checkpoint_dir)))
    written: list[Path] = []
    if _is_main():
        written = save_model_weights(
            read_sharded_model(checkpoint_dir), output_path, safe_serialization=safe_serialization
        )
        if remove_checkpoint_dir:
            shutil.rmtree(checkpoint_dir)
    if dist.is_initialized():
        dist.barrier()
    return written
