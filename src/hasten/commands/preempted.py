"""The launcher's side of preemption (see :mod:`hasten.runtime.preemption` for the workers' side).

``hasten launch`` hands SIGTERM and SIGUSR1 on to every worker, gives them
``HASTEN_PREEMPTION_GRACE`` seconds (default 25) to finish their step and save before torch's
elastic agent kills them, then reports what happened: with a checkpoint saved it exits with
:data:`~hasten.runtime.preemption.PREEMPTED_EXIT_CODE` (75), and with ``--requeue_on_preemption`` under
Slurm it runs ``scontrol requeue $SLURM_JOB_ID``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from .. import environment
from ..runtime.preemption import MARKER_FILE, PREEMPTED_EXIT_CODE
from ..settings.command import command_name
from .launch_plan import LaunchPlan

DEFAULT_GRACE_SECONDS = 25
_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


# The variable that names the folder of the preemption record, in the workers' environment.
_FOLDER = environment.variable_name("PREEMPTION_DIR")


def grace_seconds() -> int:
    """Seconds the workers get to save after a preemption signal before they are killed."""
    return environment.get_int("PREEMPTION_GRACE", DEFAULT_GRACE_SECONDS)


def prepare(plan: LaunchPlan) -> None:
    """Give the workers a folder for the preemption record; let the elastic agent forward SIGUSR1 too."""
    plan.env[_FOLDER] = tempfile.mkdtemp(prefix="hasten-preempt-")
    plan.env["TORCHELASTIC_SIGNALS_TO_HANDLE"] = _SIGNALS


def elastic_options(field_names: set[str]) -> dict:
    """Options of torch's ``LaunchConfig`` for preemption, for the fields this torch version has."""
    options = {"signals_to_handle": _SIGNALS, "shutdown_timeout": grace_seconds()}
    return {name: value for name, value in options.items() if name in field_names}


def saved_record(plan: LaunchPlan) -> dict | None:
    """What rank 0 wrote after saving its preemption checkpoint (None if it did not save one)."""
    folder = plan.env.get(_FOLDER)
    path = Path(folder, MARKER_FILE) if folder else None
    if path is None or not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


def conclude(plan: LaunchPlan, code: int, signalled: bool) -> int:
    """Report a preemption (if one happened), requeue under Slurm when asked; returns the launcher's exit code."""
    record = saved_record(plan) if code != 0 else None  # a restarted group may have finished the job since
    if record is not None:
        print(
            f"{command_name()} launch: preempted by {record['signal']}: all {record['processes']} process(es) saved "
            f"{record['checkpoint']} after optimizer step {record['step']}; exit code {PREEMPTED_EXIT_CODE}. Run the "
            "same command to resume.",
            file=sys.stderr,
            flush=True,
        )
        code = PREEMPTED_EXIT_CODE
    if (record is not None or signalled) and getattr(plan.args, "requeue_on_preemption", False):
        _requeue()
    return code


def _requeue() -> None:
    job = environment.parse_choice_from_env("SLURM_JOB_ID", "")
    if not job:
        print(
            f"{command_name()} launch: --requeue_on_preemption: SLURM_JOB_ID is not set (not a Slurm job); nothing "
            "requeued.",
            file=sys.stderr,
        )
        return
    try:
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        print(f"{command_name()} launch: `scontrol requeue {job}` failed: {exc}", file=sys.stderr)
        return
    outcome = (
        "requeued" if done.returncode == 0 else f"not requeued (exit code {done.returncode}: {done.stderr.strip()})"
    )
    print(f"{command_name()} launch: Slurm job {job} {outcome}.", file=sys.stderr, flush=True)


def cleanup(plan: LaunchPlan) -> None:
    """Remove the folder made by :func:`prepare`."""
    folder = plan.env.get(_FOLDER)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)
