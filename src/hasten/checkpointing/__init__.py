"""Checkpoints that never lose data: ``save_state``/``load_state`` of the whole training state.

``hasten.checkpointing`` keeps the public import path of ``accelerate.checkpointing``. The format (a
manifest written last, safetensors + JSON, no pickle) is described in docs/checkpointing.md.
"""

from .accelerator_state import load_state, save_state
from .background import end_background_saves, wait_for_pending_save
from .contents import CheckpointContents, check_checkpointable
from .custom import load_custom_state, save_custom_state
from .files import MANIFEST, CheckpointReader, CheckpointWriter, read_manifest
from .naming import checkpoint_path, complete_checkpoints, latest_checkpoint, rotate
from .staging import staging_memory


def save_accelerator_state(
    output_dir,
    model_states,
    optimizers,
    schedulers,
    dataloaders,
    process_index,
    step,
    scaler=None,
    save_on_each_node=False,
    safe_serialization=True,
):
    """Accelerate's low-level saver; in hasten call ``accelerator.save_state(output_dir)`` instead."""
    from ..errors import NotSupportedError

    raise NotSupportedError(
        "save_accelerator_state is internal to Accelerate; call accelerator.save_state(output_dir) instead (same "
        "contents, atomic, no pickle)."
    )


def load_accelerator_state(
    input_dir,
    models,
    optimizers,
    schedulers,
    dataloaders,
    process_index,
    scaler=None,
    map_location=None,
    load_kwargs=None,
    **load_model_func_kwargs,
):
    """Accelerate's low-level loader; in hasten call ``accelerator.load_state(input_dir)`` instead."""
    from ..errors import NotSupportedError

    raise NotSupportedError(
        "load_accelerator_state is internal to Accelerate; call accelerator.load_state(input_dir) instead."
    )


__all__ = [
    "MANIFEST",
    "CheckpointContents",
    "CheckpointReader",
    "CheckpointWriter",
    "check_checkpointable",
    "checkpoint_path",
    "complete_checkpoints",
    "end_background_saves",
    "latest_checkpoint",
    "load_accelerator_state",
    "load_custom_state",
    "load_state",
    "read_manifest",
    "rotate",
    "save_accelerator_state",
    "save_custom_state",
    "save_state",
    "staging_memory",
    "wait_for_pending_save",
]
