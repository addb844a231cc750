"""Checkpoints that never lose data: ``save_state``/``load_state`` of the whole training state.

``hasten.checkpointing`` keeps the public import path of ``accelerate.checkpointing``. The format (a
manifest written last, safetensors + JSON, no pickle) is described in docs/checkpointing.md.
"""

from .accelerator_state import CheckpointContents, check_checkpointable, load_state, save_state
from .custom import load_custom_state, save_custom_state
from .files import MANIFEST, CheckpointReader, CheckpointWriter, read_manifest
from .naming import checkpoint_path, complete_checkpoints, latest_checkpoint, rotate


__all__ = [
    "MANIFEST",
    "CheckpointContents",
    "CheckpointReader",
    "CheckpointWriter",
    "check_checkpointable",
    "checkpoint_path",
    "complete_checkpoints",
    "latest_checkpoint",
    "load_custom_state",
    "load_state",
    "read_manifest",
    "rotate",
    "save_custom_state",
    "save_state",
]
