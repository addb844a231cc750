"""Random states a process adds to a checkpoint that the main process has already published.

Under a replicated engine (one process, DDP) the main process writes the whole checkpoint and never waits for
the other processes: it takes the random states that were handed over by the time its own files are written
(see ``participants.py``) and publishes. A process that calls ``save_state`` after that (the every-process
pattern, a moment late) adds its own random states itself, once the checkpoint is published: its
``random_states_<rank>.json`` / ``.safetensors`` (the files the main process would have written), each written
beside the checkpoint's files and renamed into place once flushed, then a *part record*
``hasten_part_<rank>.json`` (written the same way, last) that lists them with their sizes and checksums and names
the save they belong to (the manifest's ``save_id``).

A reader takes a part only when its ``save_id`` is the manifest's (a part left from an earlier save into the same
folder is ignored) and only for that rank's random-state files; the part's files are then verified like the
manifest's. A folder's own files, for publishing, are the manifest's and those of its parts.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from ..runtime.fileio import atomic_write
from ..runtime.weights.files import ALIASES_KEY
from ..runtime.weights.safetensors_io import dedupe_tensors, write_safetensors
from . import integrity
from .disk import HashingFile
from .integrity import HASH_KEY, Digest, HashQueue
from .state_io import encode

_RECORD = re.compile(r"hasten_part_(\d+)\.json")


def record_name(rank: int) -> str:
    """The part record of process ``rank``."""
    return f"hasten_part_{rank}.json"


def _allowed(rank: int) -> set[str]:
    return {f"random_states_{rank}.json", f"random_states_{rank}.safetensors"}


def _records(folder: Path) -> dict[int, dict[str, Any]]:
    """Every readable part record in ``folder``, by rank (records that cannot be read are skipped)."""
    found = {}
    try:
        names = [path.name for path in folder.iterdir()]
    except OSError:
        return {}
    for name in names:
        match = _RECORD.fullmatch(name)
        if not match:
            continue
        try:
            record = json.loads((folder / name).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and isinstance(record.get("files"), dict):
            found[int(match.group(1))] = record
    return found


def owned_by_parts(folder: Path) -> set[str]:
    """The part records in ``folder`` and the files they list: hasten's files, not the user's."""
    owned = set()
    for rank, record in _records(folder).items():
        owned |= {record_name(rank)} | (set(record["files"]) & _allowed(rank))
    return owned


def read_parts(folder: Path, save_id: str | None) -> dict[str, dict[str, Any]]:
    """The files the parts of save ``save_id`` add to the checkpoint in ``folder``: name -> size and checksum."""
    if save_id is None:
        return {}
    files = {}
    for rank, record in sorted(_records(folder).items()):
        if record.get("save_id") == save_id:
            files.update({name: entry for name, entry in record["files"].items() if name in _allowed(rank)})
    return files


def add_random_states(folder: Path, save_id: str, rank: int, states: Any) -> None:
    """Add process ``rank``'s random ``states`` to the published checkpoint ``folder`` of save ``save_id``."""
    name = f"random_states_{rank}"
    tree, tensors = encode(states, name)
    unique, aliases = dedupe_tensors(tensors)
    header = {ALIASES_KEY: json.dumps(aliases)} if aliases else None
    data = json.dumps({"tree": tree, "has_tensors": bool(tensors)}, indent=1).encode("utf-8")
    fills = {f"{name}.json": lambda out: out.write(data)}
    if tensors:
        fills[f"{name}.safetensors"] = lambda out: write_safetensors(out, unique, header)
    files = {file_name: _write(folder / file_name, fill) for file_name, fill in fills.items()}
    record = {"format": "hasten-checkpoint-part", "save_id": save_id, "rank": rank, "files": files}
    atomic_write(folder / record_name(rank), lambda tmp: tmp.write_text(json.dumps(record, indent=1)))


def _write(path: Path, fill) -> dict[str, Any]:
    """Write one file through ``fill(out)`` (flushed, then renamed into place); returns its size and checksum."""
    digest, queue = Digest(HASH_KEY, integrity.PIECE_BYTES), HashQueue()
    written = {}

    def write(temporary: Path) -> None:
        with open(temporary, "wb") as raw:
            out = HashingFile(raw, digest, queue)
            fill(out)
            written["size"] = out.size
        queue.wait()

    try:
        atomic_write(path, write)
    finally:
        queue.close()
    return {"size": written["size"], HASH_KEY: digest.hexdigest()}
