"""The manifest ``hasten_checkpoint.json`` of a checkpoint folder: its format, how it is built and read, and
the checks of the files it lists.

The writer builds the manifest (see ``files.py``) from every file's size and checksum and writes it last, so
that a folder holding it is complete. The reader refuses a folder without a readable manifest, one written
by a newer hasten, and one missing a listed file or holding it at another size.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from .._version import __version__
from ..errors import CheckpointError, CheckpointNotFoundError
from . import integrity
from .publishing import MANIFEST

FORMAT_VERSION = 3  # 3: xxh3-64 of every 32 MiB piece; 2: xxh3-64 per file; 1: crc32 (both still read)


def build_manifest(info: dict[str, Any], files: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The manifest of a checkpoint holding ``files`` (name -> size and checksum), with the writer's ``info``."""
    return {
        "format": "hasten-checkpoint",
        "format_version": FORMAT_VERSION,
        "hasten_version": __version__,
        "torch_version": torch.__version__,
        **info,
        "piece_bytes": integrity.PIECE_BYTES,
        "files": dict(sorted(files.items())),
    }


def read_manifest(directory: str | os.PathLike) -> dict[str, Any]:
    """The manifest of a checkpoint folder; :class:`CheckpointError` if it is missing or unreadable."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not directory.is_dir():
        raise CheckpointNotFoundError(f"Checkpoint folder {directory} does not exist.")
    if not path.is_file():
        raise CheckpointError(
            f"{directory} is not a complete hasten checkpoint: {MANIFEST} is missing. Its save was interrupted, "
            "or it was written by another tool (see docs/checkpointing.md to migrate an Accelerate checkpoint)."
        )
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{path} is unreadable or corrupt: {error}") from error
    if manifest.get("format") != "hasten-checkpoint" or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{path} is not a hasten checkpoint manifest.")
    if manifest.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(
            f"{directory} was written by a newer hasten (format {manifest['format_version']}); upgrade hasten to load "
            "it."
        )
    return manifest


def check_listed_files(directory: Path, files: dict[str, dict[str, Any]]) -> None:
    """Check that every file the manifest lists is in ``directory``, with its size; :class:`CheckpointError`
    names the first missing or truncated one."""
    for name, record in files.items():
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"Checkpoint {directory} is missing {name!r}, which its manifest lists.")
        if path.stat().st_size != record["size"]:
            raise CheckpointError(
                f"{path} is truncated or corrupt: {path.stat().st_size} bytes where the manifest says {record['size']}."
            )
