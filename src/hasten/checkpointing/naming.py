"""Automatic checkpoint names (``<project_dir>/checkpoints/checkpoint_<i>``), the latest complete one, and rotation."""

from __future__ import annotations

import os
import re
import shutil
import uuid
import warnings
from pathlib import Path

from .files import MANIFEST

_NAME = re.compile(r"^checkpoint_(\d+)$")
_PARTIAL = re.compile(r"^\.checkpoint_(\d+)\.partial$")


def checkpoints_folder(project_dir: str | os.PathLike) -> Path:
    """The folder that holds a project's automatic checkpoints."""
    return Path(project_dir) / "checkpoints"


def checkpoint_path(project_dir: str | os.PathLike, iteration: int) -> Path:
    """Path of automatic checkpoint number ``iteration``."""
    return checkpoints_folder(project_dir) / f"checkpoint_{iteration}"


def complete_checkpoints(project_dir: str | os.PathLike, report: bool = False) -> list[tuple[int, Path]]:
    """Complete automatic checkpoints as ``(iteration, path)``, oldest first.

    With ``report``, folders left by an interrupted save (no manifest, or a ``.partial`` folder) are
    named in a warning; they are never loaded.
    """
    folder = checkpoints_folder(project_dir)
    if not folder.is_dir():
        return []
    complete, incomplete = [], []
    for entry in folder.iterdir():
        match = _NAME.match(entry.name)
        if match and entry.is_dir():
            (complete if (entry / MANIFEST).is_file() else incomplete).append((int(match.group(1)), entry))
        elif _PARTIAL.match(entry.name):
            incomplete.append((int(_PARTIAL.match(entry.name).group(1)), entry))
    if report and incomplete:
        names = ", ".join(str(path) for _, path in sorted(incomplete))
        warnings.warn(f"Ignoring incomplete checkpoint folder(s) left by an interrupted save: {names}. They can be deleted.", stacklevel=3)
    return sorted(complete)


def latest_checkpoint(project_dir: str | os.PathLike) -> Path | None:
    """The most recent complete automatic checkpoint (None when there is none)."""
    found = complete_checkpoints(project_dir, report=True)
    return found[-1][1] if found else None


def rotate(project_dir: str | os.PathLike, total_limit: int | None) -> list[Path]:
    """Delete the oldest complete checkpoints so that at most ``total_limit`` remain; returns what was deleted.

    Call only after the newest checkpoint is complete. Each folder is first renamed out of the way
    (atomically), so a crash during deletion never leaves a half-deleted checkpoint that looks complete.
    """
    if total_limit is None:
        return []
    found = complete_checkpoints(project_dir)
    doomed = [path for _, path in found[: max(len(found) - total_limit, 0)]]
    for path in doomed:
        hidden = path.parent / f".{path.name}.deleting-{uuid.uuid4().hex[:8]}"
        os.rename(path, hidden)
        shutil.rmtree(hidden, ignore_errors=True)
    return doomed
