"""The launcher's end-of-job summary of a hang: the process that did not arrive is named as the cause, the ones
that waited as waiting, in the list of failed processes and in the summary below it."""

from __future__ import annotations

import json
import signal
import sys
import types
from types import SimpleNamespace

from hasten.commands import hang_summary, job_agent, runners

_REPORT = {
    "rank": 0,
    "restart": 0,
    "operation": None,
    "collective": 10,
    "group": "the default process group",
    "waited_s": 30.4,
    "timeout_s": 30.0,
    "ranks": {
        "0": {
            "role": "waiting",
            "detail": "waited 30.4 s in it; its hang watchdog ended the job",
            "frames": [['File "/work/train.py", line 12, in <module>', "accelerator.backward(loss)"]],
        },
        "1": {
            "role": "cause",
            "detail": "did not arrive (its last collective there is #9) and waits in no collective: it holds the "
            "others up",
            "frames": [['File "/work/train.py", line 20, in sleep_instead', "time.sleep(120)"]],
        },
        "2": {"role": "waiting", "detail": "waits in it too", "frames": []},
    },
}


def test_the_summary_names_the_rank_that_did_not_arrive_first(tmp_path):
    (tmp_path / "hang_rank0.json").write_text(json.dumps(_REPORT))
    assert hang_summary.summarize(tmp_path).splitlines() == [
        "hasten launch: the job hung in collective #10 of the default process group: rank 1 did not arrive "
        "(HASTEN_HANG_TIMEOUT=30):",
        "  rank 1 did not arrive (its last collective there is #9) and waits in no collective: it holds the others up "
        "(the cause); it was at:",
        '      File "/work/train.py", line 20, in sleep_instead',
        "        time.sleep(120)",
        "  rank 0 waited 30.4 s in it; its hang watchdog ended the job; it was at:",
        '      File "/work/train.py", line 12, in <module>',
        "        accelerator.backward(loss)",
        "  rank 2 waits in it too",
        "  Every process's stacks are in the hang report that rank 0 printed.",
    ]
    assert hang_summary.summarize(tmp_path / "empty") is None
    assert hang_summary.summarize(None) is None


def test_the_failed_processes_are_labelled_with_their_part_in_the_hang(tmp_path):
    # Before, the waiting rank 0 (exit code 1, first) read as the failure and rank 1 as "stopped by the launcher
    # after another process failed".
    (tmp_path / "hang_rank0.json").write_text(json.dumps(_REPORT))
    failures = {
        0: SimpleNamespace(exitcode=1, local_rank=0, pid=100),
        1: SimpleNamespace(exitcode=-signal.SIGTERM, local_rank=1, pid=101),
        2: SimpleNamespace(exitcode=-signal.SIGTERM, local_rank=2, pid=102),
    }
    lines = runners.describe_failures(failures, 3, hang=hang_summary.load(tmp_path)).splitlines()
    assert lines[1:] == [
        "  rank 0 (local rank 0, pid 100): exit code 1; ended by the hang watchdog after it waited in collective #10 "
        "of the default process group",
        "  rank 1 (local rank 1, pid 101): stopped by the launcher (SIGTERM); the cause of the hang: it did not arrive "
        "at collective #10 of the default process group",
        "  rank 2 (local rank 2, pid 102): stopped by the launcher (SIGTERM); waited in collective #10 of the default "
        "process group",
    ]
    plain = runners.describe_failures(failures, 3).splitlines()
    assert plain[2].endswith("stopped by the launcher (SIGTERM) after another process failed")


def test_an_unreadable_report_is_named_and_only_the_last_attempt_counts(tmp_path):
    # Under --max_restarts, a hang of attempt 0 is not why attempt 1 ended: its report is left out.
    (tmp_path / "hang_rank0.json").write_text(json.dumps({**_REPORT, "restart": 0}))
    (tmp_path / "hang_rank1.json").write_text(json.dumps({**_REPORT, "rank": 1, "restart": 1}))
    (tmp_path / "hang_rank2.json").write_text("{not json")
    reports = hang_summary.load(tmp_path)
    assert [report["rank"] for report in reports] == [1, "2"]
    lines = hang_summary.summarize(tmp_path).splitlines()
    assert lines[0].startswith("hasten launch: the job hung in collective #10")
    assert lines[-1].startswith("hasten launch: unreadable hang report of rank 2 (")


def test_another_machine_learns_which_rank_did_not_arrive(tmp_path):
    # The waiting rank's machine publishes the failure for the others; before, they read "rank 0: exit code 1" only.
    (tmp_path / "hang_rank0.json").write_text(json.dumps(_REPORT))
    failures = {0: SimpleNamespace(exitcode=1, local_rank=0, pid=100, timestamp=1.0)}
    record = job_agent.failure_record(1, failures, runners.describe_exit, hang_summary.load(tmp_path))
    lines = job_agent.JobFailure(json.loads(json.dumps(record))).describe().splitlines()
    assert lines[1] == (
        "  rank 0: exit code 1; ended by the hang watchdog after it waited in collective #10 of the default process "
        "group (local rank 0, pid 100)"
    )
    assert lines[2] == (
        "hasten launch: the job hung in collective #10 of the default process group: rank 1 did not arrive "
        "(HASTEN_HANG_TIMEOUT=30):"
    )
    assert lines[-1] == "  Every process's stacks are in the hang report that rank 0 printed."
    plain = job_agent.JobFailure(job_agent.failure_record(1, failures, runners.describe_exit)).describe()
    assert plain.splitlines()[1:] == ["  rank 0: exit code 1 (local rank 0, pid 100)"]


def test_the_failure_lines_name_the_command_the_user_typed(monkeypatch):
    # Under Accelerate's name the failure summary said `hasten launch:` while every other line said
    # `accelerate launch:`.
    started = types.ModuleType("__main__")
    started.__spec__ = SimpleNamespace(name="accelerate.commands.launch")
    monkeypatch.setitem(sys.modules, "__main__", started)
    failure = SimpleNamespace(exitcode=1, local_rank=0, pid=123)
    text = runners.describe_failures({0: failure}, 2)
    assert text.splitlines()[0] == "accelerate launch: 1 of 2 process(es) failed (their output is above):", text


class _GoneStore:
    """A rendezvous store whose host is gone: every call fails as a TCPStore's does."""

    def compare_set(self, *args):
        raise RuntimeError("Connection reset by peer")

    add = check = get = compare_set


def test_a_failure_that_cannot_be_published_for_a_lost_store_names_the_store_host_as_the_cause(tmp_path, monkeypatch):
    # Machine 0's launcher killed: its workers die, machine 1's workers fail when their peers vanish, and machine 1's
    # launcher, publishing its workers' failure, finds the store gone. It reported only its own workers' exit codes
    # (the lost store was logged at debug level) when they failed before its next look at the store.
    monkeypatch.setenv("HASTEN_HANG_REPORT_DIR", str(tmp_path))
    agent = object.__new__(job_agent.JobAgent)
    agent.machine_rank, agent.remote_failure, agent._describe_exit = 1, None, runners.describe_exit
    agent._store = _GoneStore()
    failures = {0: SimpleNamespace(exitcode=1, local_rank=0, pid=100, signal_name=lambda: "", timestamp=0)}
    agent._publish(SimpleNamespace(failures=failures))
    described = agent.remote_failure.describe()
    assert (
        described.startswith("the job failed on machine 0")
        and "lost the connection to the rendezvous store" in described
    )
