"""Faults met by real launches: a failure on one machine ends the job on every machine within seconds,
a machine that cannot start stops the others from waiting for it, and no worker outlives its launcher.

Two machines are simulated by two ``hasten launch`` processes on 127.0.0.1 (one worker each, gloo).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import SCRIPTS, clean_env, free_port, hasten_launch

WORKER = str(SCRIPTS / "fault_worker.py")
LAUNCH = [sys.executable, "-m", "hasten.commands.main", "launch"]


def _start_machines(
    port: int, scripts: list[list[str]], tmp_path: Path, env: dict | None = None, ranks: list[int] | None = None
) -> list[subprocess.Popen]:
    """The launchers of a job on ``len(scripts)`` machines, each running its script; only ``ranks`` (all: None)."""
    common = [
        "--num_machines",
        "2",
        "--num_processes",
        "2",
        "--main_process_ip",
        "127.0.0.1",
        "--main_process_port",
        str(port),
    ]
    return [
        subprocess.Popen(
            [*LAUNCH, *common, "--machine_rank", str(rank), *script],
            env=env or clean_env(),
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank, script in enumerate(scripts)
        if ranks is None or rank in ranks
    ]


def _finish(machines: list[subprocess.Popen], timeout: float = 150) -> list[tuple[int, str, float]]:
    """(exit code, stderr, time it ended) of each launcher."""
    ended = []
    for machine in machines:
        _, err = machine.communicate(timeout=timeout)
        ended.append((machine.returncode, err, time.time()))
    return ended


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie has exited: it only waits to be reaped
        return stat.read().split(") ")[-1][0] != "Z"


def _wait_for_pids(folder: Path, count: int, timeout: float = 120) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = sorted(folder.glob("pid_rank*"))
        if len(files) == count and all(f.read_text() for f in files):
            return [int(f.read_text()) for f in files]
        time.sleep(0.2)
    raise AssertionError(f"the workers did not start within {timeout} s")


def _gone_within(pids: list[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(_alive(pid) for pid in pids):
            return True
        time.sleep(0.2)
    return False


@pytest.mark.serial
@pytest.mark.slow
@pytest.mark.parametrize("how, cause", [("raise", "exit code 1"), ("kill", "killed by signal SIGKILL")])
def test_a_worker_failing_on_machine_1_ends_both_launchers_within_seconds(tmp_path, how, cause):
    out = tmp_path / "out"
    script = [WORKER, str(out), "--fail_rank", "1", "--fail_at", "15", "--how", how]
    ended = _finish(_start_machines(free_port(), [script, script], tmp_path))
    failed_at = float((out / "fail_time").read_text())
    for code, err, end in ended:
        assert code != 0, err
        assert end - failed_at < 30, err
    assert "rank 1: " + cause in ended[0][1] and "the job failed on machine 1" in ended[0][1]
    assert "failed on machine 1 (their output is above):" in ended[1][1] and cause in ended[1][1]


@pytest.mark.serial
@pytest.mark.slow
def test_a_hang_across_machines_names_the_rank_that_did_not_arrive_on_every_machine(tmp_path):
    # Rank 0 (machine 0) waits in DDP's gradient all-reduce while rank 1 (machine 1) sleeps. Before, machine 1's
    # launcher said only "rank 0: exit code 1", blaming the rank that waited.
    script = [str(SCRIPTS / "fault_runtime_hang.py"), "backward"]
    env = clean_env(HASTEN_HANG_TIMEOUT="5")
    ended = _finish(_start_machines(free_port(), [script, script], tmp_path, env))
    cause = "the job hung in collective #10 of the default process group: rank 1 did not arrive (HASTEN_HANG_TIMEOUT=5)"
    for code, err, _ in ended:
        assert code == 1 and cause in err, err
    remote = ended[1][1]
    assert "launch: machine 1 stopped: the job failed on machine 0 (" in remote, remote
    assert "  rank 0: exit code 1; ended by the hang watchdog after it waited in collective #10 of the" in remote
    assert "  rank 1 did not arrive (its last collective there is #9) and waits in no collective" in remote


@pytest.mark.serial
@pytest.mark.slow
def test_a_machine_that_finished_does_not_wait_out_the_exit_barrier(tmp_path):
    out = tmp_path / "out"
    script = [WORKER, str(out), "--solo", "--steps", "1", "--fail_rank", "1", "--fail_at", "40"]
    ended = _finish(_start_machines(free_port(), [script, script], tmp_path))
    assert (out / "done_rank0").is_file()  # machine 0's worker succeeded, then its launcher waited
    failed_at = float((out / "fail_time").read_text())
    assert [code for code, _, _ in ended] == [1, 1]
    assert all(end - failed_at < 30 for _, _, end in ended)
    assert "machine 0 stopped: the job failed on machine 1" in ended[0][1] and "rank 1: exit code 1" in ended[0][1]


@pytest.mark.serial
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["static", "c10d"])
@pytest.mark.parametrize("failing", [0, 1])
def test_a_machine_that_cannot_start_stops_the_others_from_waiting(tmp_path, failing, backend):
    scripts = [["--rdzv_backend", backend, WORKER, str(tmp_path / "out")] for _ in range(2)]
    scripts[failing] = ["--rdzv_backend", backend, str(tmp_path / "no_such_script.py")]
    started = time.time()
    ended = _finish(_start_machines(free_port(), scripts, tmp_path))
    assert [code for code, _, _ in ended] == [1, 1]
    assert all(end - started < 60 for _, _, end in ended)  # the join timeout is 600 s
    other = ended[1 - failing][1]
    assert f"machine {1 - failing} stopped: machine {failing} (" in other
    assert (
        "failed before it joined the job: hasten launch: error: Training script" in other
        and "no_such_script.py" in other
    )


def _machine_1_met_by_a_bare_store(tmp_path: Path):
    """Machine 1's launcher (static rendezvous) and, in its machine 0's place, a store it has connected to."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    port = free_port()
    script = ["--rdzv_backend", "static", WORKER, str(tmp_path / "out")]
    (machine_1,) = _start_machines(port, [script, script], tmp_path, ranks=[1])
    store = TCPStore("127.0.0.1", port, 2, True, timedelta(seconds=30), wait_for_workers=False, multi_tenant=True)
    deadline = time.monotonic() + 60
    while store.num_keys() == 0 and time.monotonic() < deadline:  # machine 1's client counted itself in
        time.sleep(0.05)
    return machine_1, store


@pytest.mark.serial
@pytest.mark.slow
def test_machine_1_reads_why_machine_0_cannot_start_even_when_it_met_the_store_before_the_record(tmp_path):
    # Machine 0's launcher starts the store, then writes why it cannot start. A machine 1 that met the store in
    # between found no record, went on to exchange ranks with a machine 0 that never would, and failed with a bare
    # DistNetworkError when machine 0 gave up waiting for it (CI's fresh clone met this once).
    from hasten.commands import job_agent

    machine_1, store = _machine_1_met_by_a_bare_store(tmp_path)
    try:
        time.sleep(1)
        record = {"machine": 0, "host": "m0", "before_join": True, "cause": "no such script", "exitcode": 1}
        store.set(job_agent._FAILURE, json.dumps(record))
        deadline = time.monotonic() + 15
        while not store.check([job_agent._FAILURE_SEEN]) and time.monotonic() < deadline:
            time.sleep(0.05)
        del store
        code, err, _ = _finish([machine_1], timeout=60)[0]
        assert (
            code == 1 and "machine 1 stopped: machine 0 (m0) failed before it joined the job: no such script" in err
        ), err
    finally:
        machine_1.kill()
        machine_1.communicate()


@pytest.mark.serial
@pytest.mark.slow
def test_machine_1_names_the_lost_store_when_machine_0_vanishes_while_they_meet(tmp_path):
    # It ended with a bare DistNetworkError traceback from deep inside torch's agent.
    machine_1, store = _machine_1_met_by_a_bare_store(tmp_path)
    try:
        del store
        code, err, _ = _finish([machine_1], timeout=60)[0]
        assert code == 1 and "machine 1 stopped: the job failed on machine 0" in err, err
        assert "lost the connection to the rendezvous store" in err and "Traceback" not in err, err
    finally:
        machine_1.kill()
        machine_1.communicate()


@pytest.mark.slow
@pytest.mark.parametrize("rank, cause", [(0, "1/2 clients joined"), (1, "while trying to connect to (127.0.0.1")])
def test_a_machine_left_alone_in_the_static_rendezvous_says_so_at_the_join_timeout(tmp_path, rank, cause):
    # Both ended with a bare traceback from deep inside torch's agent (DistStoreError, DistNetworkError).
    script = ["--rdzv_backend", "static", "--rdzv_conf", "timeout=2", WORKER, str(tmp_path / "out")]
    machines = _start_machines(free_port(), [script, script], tmp_path, ranks=[rank])
    code, err, _ = _finish(machines, timeout=60)[0]
    assert code == 1 and "launch: the rendezvous at 127.0.0.1:" in err and cause in err, err
    assert "Traceback" not in err and "that machine rank 0 is reachable at --main_process_ip" in err, err


@pytest.mark.serial
@pytest.mark.slow
def test_workers_die_with_a_killed_launcher(tmp_path):
    out = tmp_path / "out"
    launcher = subprocess.Popen(
        [*LAUNCH, "-q", "--num_processes", "2", WORKER, str(out)], env=clean_env(), cwd=tmp_path
    )
    try:
        pids = _wait_for_pids(out, 2)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=10)
        assert _gone_within(pids, 10), [pid for pid in pids if _alive(pid)]
    finally:
        launcher.kill()


@pytest.mark.serial
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["debug", "notebook"])
def test_launcher_functions_take_their_processes_with_them(tmp_path, kind):
    out = tmp_path / "out"
    out.mkdir()
    command = [sys.executable, str(SCRIPTS / "fault_launcher_sleeper.py"), str(out), kind, str(free_port())]
    starter = subprocess.Popen(command, env=clean_env(), cwd=tmp_path)
    try:
        pids = _wait_for_pids(out, 2)
        starter.send_signal(signal.SIGKILL)
        starter.wait(timeout=10)
        assert _gone_within(pids, 10), [pid for pid in pids if _alive(pid)]
    finally:
        starter.kill()


@pytest.mark.slow
def test_a_restarted_group_resumes_from_the_latest_checkpoint_exactly(tmp_path):
    # Before each restart got a fresh process-group store, the new ranks could read the dead ranks'
    # addresses left in the reused one: gloo refused the connection or waited on it.
    script = SCRIPTS / "fault_resume.py"
    hasten_launch(script, str(tmp_path / "full"), launch_args=("-q", "--num_processes", "2"), timeout=300)
    restarted = tmp_path / "restarted"
    hasten_launch(
        script,
        str(restarted),
        "--kill_at",
        "13",
        launch_args=("-q", "--num_processes", "2", "--max_restarts", "1"),
        timeout=300,
    )
    assert (restarted / "final.safetensors").read_bytes() == (tmp_path / "full" / "final.safetensors").read_bytes()
    full_steps = (tmp_path / "full" / "steps_attempt0.txt").read_text().splitlines()
    resumed_steps = (restarted / "steps_attempt1.txt").read_text().splitlines()
    assert resumed_steps == full_steps[12:]  # resumed after the checkpoint of step 12, same losses to the bit


def test_the_bootstrap_runs_a_script_as_python_does_and_reports_from_the_users_frame(tmp_path):
    script = tmp_path / "user_script.py"
    script.write_text("import sys\nprint(sys.argv, __name__, sys.path[0])\nraise ValueError('from the user')\n")
    from hasten.commands.worker_bootstrap import command

    result = subprocess.run(
        command(os.getpid(), [str(script), "a", "--b"]), env=clean_env(), capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1
    assert result.stdout == f"{[str(script), 'a', '--b']} __main__ {tmp_path}\n"
    assert result.stderr.splitlines()[:2] == [
        "Traceback (most recent call last):",
        f'  File "{script}", line 3, in <module>',
    ]
    program = subprocess.run(command(os.getpid(), ["sh", "-c", "exit 4"], no_python=True), env=clean_env(), timeout=60)
    assert program.returncode == 4


def test_the_bootstrap_ends_at_once_when_its_parent_is_already_gone(tmp_path):
    from hasten.commands.worker_bootstrap import command

    marker = tmp_path / "ran"
    script = tmp_path / "user_script.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    not_its_parent = (
        os.getppid()
    )  # the child's parent is this process: as if the launcher had died before the child ran
    result = subprocess.run(command(not_its_parent, [str(script)]), env=clean_env(), timeout=60)
    assert result.returncode == -signal.SIGKILL and not marker.exists()


@pytest.mark.serial
@pytest.mark.slow
def test_killing_machine_0s_launcher_ends_the_job_on_machine_1(tmp_path):
    out = tmp_path / "out"
    machines = _start_machines(free_port(), [[WORKER, str(out)]] * 2, tmp_path)
    try:
        pids = _wait_for_pids(out, 2)
        machines[0].send_signal(signal.SIGKILL)
        killed_at = time.time()
        code, err, end = _finish(machines[1:])[0]
        assert code == 1 and end - killed_at < 30, err
        assert (
            "machine 1 stopped: the job failed on machine 0" in err
            and "lost the connection to the rendezvous store" in err
        )
        assert _gone_within(pids, 10)
    finally:
        for machine in machines:
            machine.kill()
            machine.communicate()


@pytest.mark.slow
def test_lines_printed_at_once_by_two_processes_stay_whole():
    # Under `python -u` (the launcher's former way of getting prompt output) a line and its newline were two
    # writes, and 100 to 970 of these 6000 lines came out mixed with the other process's text.
    out = hasten_launch(
        SCRIPTS / "print_long_lines.py", str(time.time() + 6), launch_args=("--cpu", "--num_processes", "2", "-q")
    ).stdout
    lines = [line for line in out.splitlines() if line.startswith("LINE")]
    mixed = [line for line in lines if not re.fullmatch(r"LINE (\d) \d+ (\d)\2{299}", line)]
    assert len(lines) == 6000 and not mixed, mixed[:3]
