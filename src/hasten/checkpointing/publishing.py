"""Where a checkpoint goes, and how it replaces what was there without touching anything else.

``save_state(output_dir)`` writes every file into a staging folder, flushes it to disk, writes the manifest
into it last, and only then *publishes* it at ``output_dir`` (the target). What publishing does depends on
what the target is:

* **nothing**: the staging folder is renamed to the target (one atomic rename).
* **an empty folder, or a folder that holds a hasten checkpoint and nothing else**: the two folders are
  swapped atomically (``renameat2(RENAME_EXCHANGE)``), so the target holds the old complete checkpoint or the
  new one at every instant; the old one is then deleted. An entry that appeared in the old folder after it
  was inspected (a log file opened at that moment) is moved back into the target before the old folder goes.
* **a folder that holds anything else** (a log, a tokenizer, notes, an Accelerate checkpoint): the user's
  folder stays where it is and only the checkpoint's files are replaced. The complete staging folder is first
  renamed to ``.<name>.publishing`` (the commit point: from here the new checkpoint is complete on disk and
  the save will be finished); each checkpoint file is then renamed into the target (replacing a file of the
  same name), the manifest last; files the previous checkpoint of that folder listed and the new one does not
  are deleted; the empty ``.publishing`` folder goes last. Nothing else in the target is opened, moved or
  deleted.
* **a file**, a symlink to a file, or a dangling symlink: refused before anything is written
  (:class:`~hasten.errors.CheckpointTargetError`). A **symlink to a folder** is followed: the checkpoint is
  published in the folder it points to, and the link stays a link.

A crash before the commit point leaves the target as it was (the previous checkpoint loads). A crash after
it leaves ``.<name>.publishing`` beside the target, holding the manifest and the files not yet moved: the
next ``save_state`` or ``load_state`` of that target first finishes the move (:func:`finish_interrupted`),
which only renames the checkpoint's own files, so the new checkpoint loads. If that cannot be done (a
read-only filesystem), ``load_state`` says so in one line, naming both folders.

When the target is a mount point, or its parent folder is not writable, the staging folder is made inside
the target instead (``<target>/.hasten.partial``), and publishing always works file by file.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import warnings
from pathlib import Path

from ..errors import CheckpointError, CheckpointTargetError
from ..runtime.fileio import fsync_directory
from .parts import owned_by_parts

MANIFEST = "hasten_checkpoint.json"
_SUPERSEDED = "superseded.json"  # inside the .publishing folder: files of the previous checkpoint to delete


def resolve_target(path: str | os.PathLike) -> Path:
    """The absolute folder a checkpoint for ``path`` goes to; refuses files before anything is written.

    A symlink to a folder is followed (its target folder receives the checkpoint, the link stays).

    Raises:
        CheckpointTargetError: ``path`` is an existing file, a symlink to one, or a dangling symlink.
    """
    given = Path(path).absolute()
    final = Path(os.path.realpath(given)) if given.is_symlink() else given
    if given.is_symlink() and not final.exists():
        raise CheckpointTargetError(
            f"Cannot save a checkpoint to {given}: it is a symbolic link to {final}, which does not exist. Nothing was "
            "written; create that folder, or give save_state another folder."
        )
    if final.exists() and not final.is_dir():
        via = f" (the target of the symbolic link {given})" if final != given else ""
        raise CheckpointTargetError(
            f"Cannot save a checkpoint to {final}{via}: it is an existing file, not a folder. Nothing was written; "
            "give save_state a folder (a new one, or an existing one: its other files are kept)."
        )
    return final


def _stages_inside(final: Path) -> bool:
    """True when the staging folder must live inside ``final``: a mount point, or a parent that is not writable."""
    if not final.is_dir():
        return False
    return final.stat().st_dev != final.parent.stat().st_dev or not os.access(final.parent, os.W_OK)


def staging_folder(final: Path) -> Path:
    """The folder a checkpoint for ``final`` is written into before it is published (the same on every process)."""
    return final / ".hasten.partial" if _stages_inside(final) else final.parent / f".{final.name}.partial"


def publishing_folder(final: Path) -> Path:
    """Where a committed in-folder publish keeps the files it has not moved into ``final`` yet."""
    inside = final / ".hasten.publishing"
    return inside if inside.exists() or _stages_inside(final) else final.parent / f".{final.name}.publishing"


def _listed(manifest_path: Path, parts: bool = True) -> set[str] | None:
    """The files a manifest lists, and (``parts``) those its folder's parts add (see ``parts.py``); None when there
    is no readable hasten manifest."""
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError):
        return None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if manifest.get("format") != "hasten-checkpoint" or not isinstance(files, dict):
        return None
    return set(files) | (owned_by_parts(manifest_path.parent) if parts else set())


def _entries(folder: Path) -> list[str]:
    """Every file, link and empty folder under ``folder``, relative (staging folders made inside it excluded)."""
    found = []
    for root, dirs, files in os.walk(folder):
        relative = Path(root).relative_to(folder)
        if relative == Path("."):
            dirs[:] = [d for d in dirs if d not in (".hasten.partial", ".hasten.publishing")]
        links = [d for d in dirs if os.path.islink(os.path.join(root, d))]
        dirs[:] = [d for d in dirs if d not in links]
        found += [(relative / name).as_posix() for name in files + links]
        if not dirs and not files and not links and relative != Path("."):
            found.append(relative.as_posix() + "/")
    return found


def holds_only_a_checkpoint(folder: Path) -> bool:
    """True when ``folder`` is empty or holds exactly the files its hasten manifest lists, and the manifest."""
    entries = _entries(folder)
    if not entries:
        return True
    listed = _listed(folder / MANIFEST)
    return listed is not None and set(entries) <= listed | {MANIFEST}


def publish(staging: Path, final: Path) -> None:
    """Publish the complete ``staging`` folder (manifest included) at ``final``, keeping every file of the
    user's that ``final`` holds (see the module's description). Raises ``OSError`` when nothing was changed
    and :class:`CheckpointError` when the publish is committed but could not be finished."""
    finish_interrupted(final)
    if not final.exists():
        os.rename(staging, final)
    elif not (staging.parent == final.parent and holds_only_a_checkpoint(final) and _exchange(staging, final)):
        _publish_into(staging, final)
        return
    else:
        _drop_swapped_out(staging, final)
    fsync_directory(final.parent)


def _drop_swapped_out(old: Path, final: Path) -> None:
    """After a swap, delete the previous checkpoint (now at ``old``); the new one is published whatever happens here."""
    try:
        _return_foreign_entries(old, final)
        shutil.rmtree(old)
    except OSError as error:
        warnings.warn(
            f"The checkpoint {final} was saved, but the previous checkpoint of that folder, moved to {old}, could not "
            f"be deleted ({error}); delete it yourself.",
            stacklevel=2,
        )


def _exchange(source: Path, target: Path) -> bool:
    """Atomically swap two paths with renameat2(RENAME_EXCHANGE); False where unsupported."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(source), at_fdcwd, os.fsencode(target), rename_exchange) == 0


def _return_foreign_entries(old: Path, final: Path) -> None:
    """After a swap: move back into ``final`` whatever the old folder holds that its manifest does not list
    (a file created in it between the inspection and the swap)."""
    listed = (_listed(old / MANIFEST) or set()) | {MANIFEST}
    for name in os.listdir(old):
        if name in listed or any(entry.startswith(f"{name}/") for entry in listed):
            continue
        if not os.path.lexists(final / name):
            os.rename(old / name, final / name)


def _collisions(final: Path, names: list[str]) -> list[str]:
    """Checkpoint files whose place in ``final`` is taken by something that is not a plain file."""
    bad = []
    for name in names:
        place = final / name
        parents = [final / parent for parent in Path(name).parents if str(parent) != "."]
        if any(os.path.lexists(p) and (p.is_symlink() or not p.is_dir()) for p in parents):
            bad.append(name)
        elif os.path.lexists(place) and (place.is_dir() and not place.is_symlink()):
            bad.append(name)
    return bad


def _publish_into(staging: Path, final: Path) -> None:
    """The in-folder publish: commit (rename to ``.publishing``), then move the checkpoint's files in."""
    names = sorted(_listed(staging / MANIFEST) or ())
    bad = _collisions(final, names)
    if bad:
        removed = "was removed" if remove_staging(staging) else f"{staging} could not be removed: delete it"
        raise CheckpointError(
            f"Could not save the checkpoint {final}: {final / bad[0]} is in the way (the checkpoint writes a file "
            f"there, and it is a folder, or a folder on its path is not). Nothing in the folder was changed (the "
            f"staging folder {removed}); move it aside, or save elsewhere."
        )
    previous = _listed(final / MANIFEST)
    if previous:
        (staging / _SUPERSEDED).write_text(json.dumps(sorted(previous - set(names))))
    publishing = publishing_folder(final)
    os.rename(staging, publishing)
    fsync_directory(publishing.parent)
    try:
        _move_in(publishing, final)
    except OSError as error:
        raise CheckpointError(interrupted_message(final, publishing, error)) from error


def finish_interrupted(final: Path) -> bool:
    """Finish an in-folder publish that was committed and then interrupted (a crash, a failure); True if
    there was one. Idempotent: several processes may call it at once."""
    publishing = publishing_folder(final)
    if not publishing.is_dir():
        return False
    try:
        _move_in(publishing, final)
    except OSError as error:
        raise CheckpointError(interrupted_message(final, publishing, error)) from error
    return True


def interrupted_message(final: Path, publishing: Path, error: OSError) -> str:
    """The one line for a committed publish that could not be finished."""
    return (
        f"The checkpoint {final} is complete but could not be moved into place ({error.strerror or error} at "
        f"{error.filename or publishing}): its files not moved yet are in {publishing}, and the folder's own "
        f"manifest is still the previous one. Fix the cause and call save_state or load_state on {final} again: "
        "either one finishes the move first. Your other files in the folder were not touched."
    )


def _move_in(publishing: Path, final: Path) -> None:
    """Move every file of ``publishing`` into ``final`` (the manifest last), delete the previous checkpoint's
    files that the new one does not list, then remove ``publishing``. A file already moved is skipped."""
    manifest = _listed(publishing / MANIFEST)
    names = sorted(manifest or ())
    touched = {final}
    for name in names:
        source = publishing / name
        if not source.exists():
            continue  # moved already (by an earlier attempt or another process)
        (final / name).parent.mkdir(parents=True, exist_ok=True)
        _rename_if_present(source, final / name)
        touched.add((final / name).parent)
    for folder in touched:
        fsync_directory(folder)
    _rename_if_present(publishing / MANIFEST, final / MANIFEST)
    fsync_directory(final)
    _delete_superseded(publishing, final)  # the new checkpoint is in place: what follows is tidying only
    shutil.rmtree(publishing, ignore_errors=True)
    fsync_directory(publishing.parent)


def _rename_if_present(source: Path, target: Path) -> None:
    try:
        os.rename(source, target)
    except FileNotFoundError:
        if source.exists() or not target.exists():
            raise


def _delete_superseded(publishing: Path, final: Path) -> None:
    """Delete the previous checkpoint's files that the new manifest does not list (hasten wrote them)."""
    try:
        stale = json.loads((publishing / _SUPERSEDED).read_text())
    except (OSError, ValueError):
        return
    current = _listed(final / MANIFEST, parts=False) or set()  # the earlier save's parts go too
    for name in stale:
        if name not in current:
            try:
                (final / name).unlink()
            except OSError:
                continue
            _remove_empty_parents(final, Path(name).parent)


def _remove_empty_parents(final: Path, relative: Path) -> None:
    while str(relative) != ".":
        try:
            (final / relative).rmdir()
        except OSError:
            return
        relative = relative.parent


def remove_staging(staging: Path) -> bool:
    """Remove a staging folder; True when it is gone afterwards."""
    shutil.rmtree(staging, ignore_errors=True)
    return not os.path.lexists(staging)
