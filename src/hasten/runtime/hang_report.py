"""The hang report: what the process that waited longest prints and writes when the hang timeout ends the job.

It names the collective (its number in its process group, and hasten's operation when the wait is inside one),
says for every rank whether it waits in that collective or did not arrive, and which one is the cause (see
:mod:`hasten.runtime.hang_analysis`), with where each rank is in the user's code and every process's stacks. The
record written as ``hang_rank<N>.json`` carries the same, for ``hasten launch``'s end-of-job summary.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .. import environment
from . import hang_analysis, stack_dump
from .hang_analysis import Wait


@dataclass
class Hang:
    """What the reporting process knows when it ends the job."""

    rank: int
    wait: Wait
    waited: float
    timeout: float
    operation: str | None  # hasten's operation the wait is inside, if any
    positions: dict[int, dict | None]  # every rank's published position, the reporter's own included
    stacks: dict[int, str]  # every rank's stacks (or why there are none)


def _cause_line(hang: Hang, roles: dict[int, str]) -> str:
    causes = [rank for rank, role in roles.items() if role in ("cause", "exited")]
    deadlocked = [rank for rank, role in roles.items() if role == "deadlocked"]
    if causes:
        return f"{_ranks(causes)} did not arrive"
    if deadlocked:
        return f"{_ranks(deadlocked)} did not arrive, waiting in another collective themselves (a deadlock)"
    return "every rank arrived, as far as their published positions tell"


def _issued(wait: Wait) -> str:
    if wait.issued is None:
        return ""
    return f" (it issued up to #{wait.issued}: the collectives run asynchronously)"


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def describe_rank(hang: Hang, rank: int, role: str) -> str:
    """What rank ``rank`` did about the collective, in words that follow "rank N" (without where it is)."""
    position = hang.positions.get(rank) or {}
    count = hang.wait.behind.get(rank)
    last = f"its last collective there is #{count}" if count is not None else "it published no count"
    if role == "waiting" and rank == hang.rank:
        inside = f", inside `{hang.operation}`" if hang.operation else ""
        return f"waited {hang.waited:.1f} s in it{inside}; its hang watchdog ended the job"
    if role == "waiting":
        return "waits in it too"
    if role == "exited":
        error = position.get("error")
        return f"exited without arriving ({last})" + (f", after an uncaught {error}" if error else "")
    if role == "deadlocked":
        other = hang_analysis.find_wait(rank, hang.positions)
        assert other is not None  # roles() says so
        return (
            f"did not arrive ({last}): it waits itself in collective #{other.collective} of "
            f"{hang_analysis.describe_group(other.group)}, which {_ranks(sorted(other.behind))} did not reach"
        )
    if not position:
        return "did not arrive: it never published where it is (it is gone, or never created the process group)"
    return f"did not arrive ({last}) and waits in no collective: it holds the others up"


def _at(frames: list[list[str]]) -> str:
    """Where a rank is in the user's code: its innermost frame, with the source line."""
    if not frames:
        return ""
    innermost = frames[-1]
    found = re.match(r'File "(.*)", line (\d+),? in (.*)', innermost[0])
    place = f"{found[1]}:{found[2]} in {found[3]}" if found else innermost[0]
    return f", at {place}" + (f": {innermost[1]}" if len(innermost) > 1 else "")


_TIMEOUT = environment.variable_name("HANG_TIMEOUT")


def build(hang: Hang) -> tuple[str, dict]:
    """The report's text and the record for ``hang_rank<N>.json``."""
    wait = hang.wait
    roles = hang_analysis.roles(wait, hang.positions)
    group = hang_analysis.describe_group(wait.group)
    inside = f", inside `{hang.operation}`" if hang.operation else ""
    lines = [
        "",
        f"[hasten] rank {hang.rank} has waited {hang.waited:.1f} s ({_TIMEOUT}={hang.timeout:g}) in "
        f"collective #{wait.collective} of {group}{inside}{_issued(wait)}; {_cause_line(hang, roles)}.",
        "Where every rank is:",
    ]
    ranks, where = {}, {}
    for rank in sorted(roles):
        frames = stack_dump.user_frames(hang.stacks.get(rank, ""))
        detail = describe_rank(hang, rank, roles[rank])
        ranks[str(rank)] = {"role": roles[rank], "detail": detail, "frames": frames}
        where[rank] = f"  - rank {rank} {detail}{_at(frames)}"
    lines += where.values()
    lines += [
        "Every rank must issue the same collectives in the same order (also DDP's gradient all-reduce: the same "
        "backward passes). A rank that did not arrive skipped the collective or is stuck elsewhere: its stack below "
        f"says where. Raise {_TIMEOUT} if a rank legitimately works alone this long.",
    ]
    lines += [f"Stack of rank {rank}:\n{hang.stacks.get(rank, '(none)')}" for rank in sorted(hang.stacks)]
    text = "\n".join(lines)
    peers = "\n".join(line for rank, line in where.items() if rank != hang.rank)
    record = {
        "rank": hang.rank,
        "operation": hang.operation,
        "collective": wait.collective,
        "group": group,
        "waited_s": round(hang.waited, 2),
        "timeout_s": hang.timeout,
        "ranks": ranks,
        "stack": hang.stacks.get(hang.rank, ""),
        "peers": peers,
        "peer_stacks": "\n".join(f"Stack of rank {r}:\n{s}" for r, s in sorted(hang.stacks.items()) if r != hang.rank),
    }
    return text, record
