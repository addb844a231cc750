"""Who waits for whom in a hang: every process's collective count per process group, compared.

torch counts the collectives each process issues in each process group (``_get_sequence_number_for_group``,
kept by gloo and NCCL alike, the same number on every member once they all issued the same collectives). Every
collective counts, whoever issues it: DDP's gradient all-reduce inside ``backward`` and its bucket hooks, FSDP's
and DeepSpeed's collectives, torch's own ``dist.barrier``, hasten's operations. Reading the counts costs the
training loop nothing: the hang watchdog thread reads them once per period. Point-to-point ``send``/``recv``
count too (on both ends only), so a pipeline-parallel job's counts may differ between ranks that are not stuck;
a hang is still found, but the rank named as not arrived may be wrong there, and the stacks tell.

A process that issued collective #N of a group that another member has not issued (its count is lower) waits in
it; the members with the lower count did not arrive. Among those, one that waits itself in another group is part
of a deadlock; one that waits nowhere is the cause: it is stuck elsewhere (its stack says where) or skipped the
collective.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

DEFAULT_GROUP = "0"  # torch's name of the default process group


def counters() -> dict[str, int]:
    """This process's count of issued collectives per process group it belongs to (``name``, or ``name:device``
    for a group with a backend per device type, e.g. gloo for CPU tensors beside NCCL)."""
    world = dist.distributed_c10d._world
    found: dict[str, int] = {}
    for group, name in list(world.pg_names.items()):
        backends = {}
        for device in group._device_types:
            try:
                backend = group._get_backend(device)
            except RuntimeError:
                continue
            backends.setdefault(id(backend), (device.type, backend))
        for device, backend in backends.values():
            key = name if len(backends) == 1 else f"{name}:{device}"
            found[key] = backend._get_sequence_number_for_group()
    return found


def describe_group(key: str) -> str:
    """A process group's key (from :func:`counters`) in words: the default group, or the group's number, its
    description (DeviceMesh dimension, ...) and its ranks."""
    name, _, device = key.partition(":")
    if name == DEFAULT_GROUP:
        words = "the default process group"
    else:
        group = next((g for g, n in list(dist.distributed_c10d._world.pg_names.items()) if n == name), None)
        details = [] if group is None or group.group_desc == "undefined" else [group.group_desc]
        if group is not None:
            ranks = dist.get_process_group_ranks(group)
            details.append(f"ranks {', '.join(map(str, ranks))}" if len(ranks) <= 8 else f"{len(ranks)} ranks")
        words = f"process group {name}" + (f" ({'; '.join(details)})" if details else "")
    return f"{words}, {device} backend" if device else words


@dataclass
class Wait:
    """A collective some members have not issued: ``group``'s collective number ``collective``, the first one that a
    member did not issue; ``behind``: the members that did not arrive, with their own count (None: unknown, the
    process published none); ``issued``: the waiting rank's own count when it issued later ones too (NCCL runs
    collectives asynchronously, so a rank goes on until something waits for the GPU), else None."""

    group: str
    collective: int
    behind: dict[int, int | None] = field(default_factory=dict)
    issued: int | None = None


def _count(position: dict | None, group: str) -> int | None:
    groups = (position or {}).get("groups") or {}
    return groups.get(group)


def _members(group: str, positions: dict[int, dict | None]) -> list[int]:
    """The ranks in ``group``: those that published a count for it; one that published nothing is counted in the
    default group (every process belongs to it)."""
    return [
        rank
        for rank, position in positions.items()
        if _count(position, group) is not None or (position is None and group.split(":")[0] == DEFAULT_GROUP)
    ]


def find_wait(rank: int, positions: dict[int, dict | None]) -> Wait | None:
    """The collective that ``rank`` waits in, going by everyone's published counts (``positions``: every rank's
    position, ``rank``'s own included), or None when every member of its groups issued as many as it did."""
    mine = (positions.get(rank) or {}).get("groups") or {}
    for group in sorted(mine, key=lambda key: (key.split(":")[0] != DEFAULT_GROUP, key)):
        behind = {}
        for other in _members(group, positions):
            count = _count(positions[other], group)
            if other != rank and (count is None or count < mine[group]):
                behind[other] = count
        if behind:
            known = [count for count in behind.values() if count is not None]
            first = min(known) + 1 if known else mine[group]
            return Wait(group, first, behind, mine[group] if mine[group] > first else None)
    return None


def roles(wait: Wait, positions: dict[int, dict | None]) -> dict[int, str]:
    """What each rank did about ``wait``: ``waiting`` (it issued the collective), ``exited``, ``deadlocked`` (it did
    not arrive because it waits in a collective of another group itself) or ``cause`` (it did not arrive and waits
    in no collective: stuck elsewhere, or it skipped the collective)."""
    found = {}
    for rank in _members(wait.group, positions):
        position = positions[rank]
        if rank not in wait.behind:
            found[rank] = "waiting"
        elif position is not None and position.get("status") == "exited":
            found[rank] = "exited"
        elif find_wait(rank, positions) is not None:
            found[rank] = "deadlocked"
        else:
            found[rank] = "cause"
    return found
