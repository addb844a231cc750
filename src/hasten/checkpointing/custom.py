"""Saving one registered object outside a full checkpoint (Accelerate's ``save_custom_state``/``load_custom_state``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..runtime.fileio import atomic_write
from ..runtime.weights.safetensors_io import read_header, read_tensors, write_safetensors
from ..state import PartialState
from .state_io import decode, encode


def save_custom_state(obj, path: str | os.PathLike, index: int = 0, save_on_each_node: bool = False) -> None:
    """Write ``obj.state_dict()`` as ``custom_checkpoint_<index>.json`` (+ ``.safetensors``) into folder ``path``.

    ``save_state`` already saves objects given to ``register_for_checkpointing``; this is the standalone form.
    Each file is written atomically; no pickle is used.
    """
    state = PartialState()
    if not (state.is_local_main_process if save_on_each_node else state.is_main_process):
        return
    name = f"custom_checkpoint_{index}"
    tree, tensors = encode(obj.state_dict(), name)
    folder = Path(path)
    if tensors:
        atomic_write(folder / f"{name}.safetensors", lambda tmp: _write_tensors(tmp, tensors))
    atomic_write(
        folder / f"{name}.json", lambda tmp: tmp.write_text(json.dumps({"tree": tree, "has_tensors": bool(tensors)}))
    )


def _write_tensors(path: Path, tensors) -> None:
    with open(path, "wb") as handle:
        write_safetensors(handle, tensors)


def load_custom_state(obj, path: str | os.PathLike, index: int = 0) -> None:
    """Restore an object saved by :func:`save_custom_state` from folder ``path``."""
    folder = Path(path)
    name = f"custom_checkpoint_{index}"
    meta = json.loads((folder / f"{name}.json").read_text())
    tensors = dict(read_tensors(read_header(folder / f"{name}.safetensors"))) if meta.get("has_tensors") else {}
    obj.load_state_dict(decode(meta["tree"], tensors))
