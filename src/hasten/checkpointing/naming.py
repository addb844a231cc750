"""Automatic checkpoint names (``<project_dir>/checkpoints/checkpoint_<i>``), the latest complete one, and rotation."""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
import warnings
from pathlib import Path

from .publishing import MANIFEST, holds_only_a_checkpoint

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
        warnings.warn(
            f"Ignoring incomplete checkpoint folder(s) left by an interrupted save: {names}. They can be deleted.",
            stacklevel=3,
        )
    return sorted(complete)


def latest_checkpoint(project_dir: str | os.PathLike) -> Path | None:
    """The most recent complete automatic checkpoint (None when there is none)."""
    found = complete_checkpoints(project_dir, report=True)
    return found[-1][1] if found else None


def made_by_rotation(path: Path) -> bool:
    """True when ``path`` is a checkpoint that automatic naming wrote: its hasten manifest records the
    iteration its name carries (an explicit ``save_state(path)``, a copied folder or another tool's folder
    of the same name does not)."""
    match = _NAME.match(path.name)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return (
        bool(match)
        and isinstance(manifest, dict)
        and manifest.get("format") == "hasten-checkpoint"
        and manifest.get("iteration") == int(match.group(1))
    )


def rotate(project_dir: str | os.PathLike, total_limit: int | None) -> list[Path]:
    """Delete the oldest automatic checkpoints so that at most ``total_limit`` remain; returns what was deleted.

    Only folders automatic naming wrote count (:func:`made_by_rotation`); a folder of the same name saved
    explicitly, or written by another tool, is neither counted nor deleted. Call only after the newest
    checkpoint is complete. A folder holding nothing but its checkpoint is first renamed out of the way
    (atomically), so a crash during deletion never leaves a half-deleted checkpoint that looks complete; in
    one that also holds files of the user's, the manifest goes first, then the checkpoint's own files, and
    the user's files stay.
    """
    if total_limit is None:
        return []
    found = [path for _, path in complete_checkpoints(project_dir) if made_by_rotation(path)]
    doomed = found[: max(len(found) - total_limit, 0)]
    for path in doomed:
        _delete_checkpoint(path)
    return doomed


def _delete_checkpoint(path: Path) -> None:
    if holds_only_a_checkpoint(path):
        hidden = path.parent / f".{path.name}.deleting-{uuid.uuid4().hex[:8]}"
        os.rename(path, hidden)
        shutil.rmtree(hidden, ignore_errors=True)
        return
    listed = json.loads((path / MANIFEST).read_text())["files"]
    (path / MANIFEST).unlink()
    for name in listed:
        (path / name).unlink(missing_ok=True)
    folders = {parent for name in listed for parent in Path(name).parents if str(parent) != "."}
    for folder in sorted(folders, key=lambda p: -len(p.parts)):
        if (path / folder).is_dir() and not any((path / folder).iterdir()):
            (path / folder).rmdir()
