"""The random states a run restores when it resumes on another number of processes than the one that saved.

A checkpoint holds one ``random_states_<rank>`` per saving process (python, numpy, torch and CUDA
generators). Resumed on ``M`` processes from a checkpoint of ``N``:

* a process ``r < N`` restores process ``r``'s state, as on the same number of processes (with
  ``M < N`` the states of processes ``M .. N-1`` are not used);
* a process ``r >= N`` has no state of its own. When the saved processes share one state (saved
  processes 0, 1 and ``r % N`` hold the same one; a checkpoint of one process counts as shared), it
  takes that state: processes seeded alike (``set_seed(s)``) and drawing alike keep one common state,
  which an uninterrupted run on ``M`` processes would have had on every process too. Otherwise
  (``set_seed(s, device_specific=True)``, or processes that drew differently) it is seeded with
  ``set_seed(b + r)``, where ``b`` is drawn from saved process 0's torch state: a different stream
  on each process, and the same one on every resume from this checkpoint.

The main process says once, in one warning line, what each process without a state of its own got.
Loader positions are not random states: they are kept in samples of the global order and map exactly
(see :mod:`hasten.data_loader.position`).
"""

from __future__ import annotations

import re
import warnings
from typing import Any

import torch

from ..runtime.rng import capture_rng_states, restore_rng_states, set_seed

_RNG_FILE = re.compile(r"random_states_(\d+)\.(json|pkl)")


def saved_world_size(reader) -> int | None:
    """Processes that saved the checkpoint: the manifest's ``world_size``, else one more than the highest rank
    with a random state file (Accelerate's folders record no world size)."""
    recorded = reader.manifest.get("world_size")
    if recorded:
        return int(recorded)
    ranks = [int(m.group(1)) for name in reader.files if (m := _RNG_FILE.fullmatch(name))]
    return max(ranks) + 1 if ranks else None


def random_state_for(reader, rank: int, world: int) -> dict[str, Any] | None:
    """The random state process ``rank`` of a ``world``-process run restores (None: the checkpoint has none for it).

    Reads only; warns (main process) when the number of processes changed and processes were given a state
    that is not their own.
    """
    saved = saved_world_size(reader)
    if saved is None or saved == world or rank < saved:
        if saved is not None and saved != world and rank == 0:
            _announce(reader, saved, world)
        return _load(reader, rank)
    source = _load(reader, rank % saved)
    if source is None:
        return None
    first = _load(reader, 0)
    return source if _shared(reader, saved, source, first) else _reseeded(_base(first) + rank)


def _shared(reader, saved: int, source: dict[str, Any], first: dict[str, Any] | None) -> bool:
    """Whether the saved processes share one random state (judged from processes 0, 1 and the source)."""
    return _same(source, first) and (saved == 1 or _same(_load(reader, 1), first))


def _load(reader, rank: int) -> dict[str, Any] | None:
    name = f"random_states_{rank}"
    return reader.load_state(name) if reader.exists(f"{name}.json") else None


def _same(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    if a is None or b is None or a["meta"] != b["meta"] or a["tensors"].keys() != b["tensors"].keys():
        return False
    return all(torch.equal(a["tensors"][k], b["tensors"][k]) for k in a["tensors"])


def _base(state: dict[str, Any] | None) -> int:
    """A seed drawn from saved process 0's torch state (0 when there is none)."""
    if state is None:
        return 0
    generator = torch.Generator()
    generator.set_state(state["tensors"]["torch"])
    return int(torch.randint(0, 2**31, (1,), generator=generator).item())


def _reseeded(seed: int) -> dict[str, Any]:
    """The state ``set_seed(seed)`` gives, captured without changing this process's live generators."""
    meta, tensors = capture_rng_states()
    set_seed(seed)
    fresh = capture_rng_states()
    restore_rng_states(meta, tensors)
    return {"meta": fresh[0], "tensors": fresh[1]}


def _announce(reader, saved: int, world: int) -> None:
    """The main process's one line about the random states of a run resumed on ``world`` processes."""
    where = f"Checkpoint {reader.directory} was saved by {saved} process(es) and is resumed on {world}"
    if world < saved:
        own, unused = _ranks(list(range(world))), _ranks(list(range(world, saved)))
        warnings.warn(
            f"{where}: process(es) {own} restore their own random states; those of process(es) {unused} are not used.",
            stacklevel=7,
        )
        return
    first = _load(reader, 0)
    shared = [r for r in range(saved, world) if _shared(reader, saved, _load(reader, r % saved), first)]
    reseeded = [r for r in range(saved, world) if r not in shared]
    told = []
    if shared:
        told.append(f"process(es) {_ranks(shared)} took the random state every saved process shared")
    if reseeded:
        told.append(
            f"process(es) {_ranks(reseeded)} were seeded with set_seed({_base(first)} + rank) (the saved "
            "processes' random states differ, so none is theirs; the base is drawn from saved process 0's torch "
            "state, the same on every resume)"
        )
    warnings.warn(
        f"{where}: process(es) {_ranks(list(range(saved)))} restore their own random states; {'; '.join(told)}.",
        stacklevel=7,
    )


def _ranks(ranks: list[int]) -> str:
    return (
        f"{ranks[0]}-{ranks[-1]}"
        if len(ranks) > 2 and ranks[-1] - ranks[0] == len(ranks) - 1
        else ", ".join(map(str, ranks))
    )
