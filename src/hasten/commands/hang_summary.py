"""The end-of-job summary of a hang: which process did not arrive (the cause) and which ones waited.

The process whose hang watchdog ended the job writes ``hang_rank<N>.json`` into ``HASTEN_HANG_REPORT_DIR`` (see
:mod:`hasten.runtime.hang_report`): the collective, each rank's role (``waiting``, ``cause``, ``deadlocked``,
``exited``), what it was doing and the innermost frames of the user's code. ``hasten launch`` gives every
multi-process job such a folder; after a failed job it labels each failed process with its role (the process
that waited exits 1 first, but the one that did not arrive is the cause) and prints this summary.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from .. import environment
from ..settings.command import command_name
from .launch_plan import LaunchPlan

_ROLES = {
    "cause": "the cause of the hang: it did not arrive at",
    "deadlocked": "it did not arrive, waiting in another collective itself (a deadlock), at",
    "exited": "it exited without arriving at",
}


_TIMEOUT = environment.variable_name("HANG_TIMEOUT")


def prepare(plan: LaunchPlan) -> None:
    """Give the job a folder for hang reports: ``HASTEN_HANG_REPORT_DIR`` if set, else a temporary one that the
    launcher removes at the end."""
    folder = environment.get_str("HANG_REPORT_DIR")
    if folder:
        plan.hang_dir = Path(folder)
    else:
        plan.hang_dir = Path(tempfile.mkdtemp(prefix="hasten-hang-"))
        plan.owns_hang_dir = True
    plan.env[environment.variable_name("HANG_REPORT_DIR")] = str(plan.hang_dir)


def load(folder: Path | None) -> list[dict]:
    """The hang reports in ``folder``, lowest rank first.

    Under ``--max_restarts`` only the reports of the last attempt that wrote any are kept: a hang of an earlier
    attempt is not the reason the job ended (unreadable reports are always kept)."""
    if folder is None:
        return []
    reports = []
    for path in Path(folder).glob("hang_rank*.json"):
        try:
            reports.append(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError) as exc:
            reports.append({"rank": path.stem.removeprefix("hang_rank"), "unreadable": f"{path}: {exc}"})
    last = max((r["restart"] for r in reports if isinstance(r.get("restart"), int)), default=0)
    reports = [r for r in reports if r.get("restart", last) == last]
    return sorted(reports, key=lambda r: int(r["rank"]) if str(r.get("rank", "")).isdigit() else -1)


def _collective(report: dict) -> str:
    return f"collective #{report.get('collective', '?')} of {report.get('group', 'a process group')}"


def role(reports: list[dict], rank: int) -> str | None:
    """What process ``rank`` did in the hang, for its line in the list of failed processes (None: not in one)."""
    for report in reports:
        entry = (report.get("ranks") or {}).get(str(rank))
        if entry is None:
            continue
        if entry.get("role") == "waiting":
            ended = "ended by the hang watchdog after it waited" if report.get("rank") == rank else "waited"
            return f"{ended} in {_collective(report)}"
        return f"{_ROLES.get(entry.get('role'), 'it did not arrive at')} {_collective(report)}"
    return None


def summarize(folder: Path | None) -> str | None:
    """The summary of the hang reports in ``folder`` (None if there are none): see :func:`summary_of`."""
    return summary_of(load(folder))


def summary_of(reports: list[dict]) -> str | None:
    """The summary of hang reports (:func:`load`; None if there are none): the rank(s) that did not arrive first,
    with what they were doing, then the waiting ones."""
    if not reports:
        return None
    lines = []
    for report in reports:
        if "unreadable" in report:
            lines.append(
                f"{command_name()} launch: unreadable hang report of rank {report['rank']} ({report['unreadable']})"
            )
            continue
        ranks = report.get("ranks") or {}
        late = [rank for rank, entry in ranks.items() if entry.get("role") != "waiting"]
        who = (
            ("rank " if len(late) == 1 else "ranks ") + ", ".join(late) + " did not arrive"
            if late
            else "every rank arrived"
        )
        timeout = report.get("timeout_s")
        limit = f" ({_TIMEOUT}={timeout:g})" if isinstance(timeout, (int, float)) else ""
        lines.append(f"{command_name()} launch: the job hung in {_collective(report)}: {who}{limit}:")
        for rank in sorted(ranks, key=lambda rank: (ranks[rank].get("role") == "waiting", int(rank))):
            entry = ranks[rank]
            cause = " (the cause)" if entry.get("role") == "cause" else ""
            frames = entry.get("frames") or []
            lines.append(f"  rank {rank} {entry.get('detail', '')}{cause}" + ("; it was at:" if frames else ""))
            lines += [
                f"{'      ' if index == 0 else '        '}{line}"
                for frame in frames
                for index, line in enumerate(frame)
            ]
        lines.append(f"  Every process's stacks are in the hang report that rank {report.get('rank')} printed.")
    return "\n".join(lines)
