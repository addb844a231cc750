"""Runtime faults across 2 real gloo processes: bounded hangs and their stacks, mismatched collectives, a rank that
leaves early, rank-consistent gathers, OOM recovery inside a step."""

import json
import time

import pytest
from helpers import SCRIPTS, clean_env, hasten_launch, torchrun

pytestmark = pytest.mark.slow


@pytest.mark.serial
def test_a_hung_torch_barrier_ends_the_job_with_the_stuck_rank_named():
    # torch's own dist.barrier, under torchrun: before, only hasten's operations were watched and the job waited
    # for the process group's timeout (the hang timeout + 60 s) without a stack.
    start = time.monotonic()
    env = clean_env(HASTEN_HANG_TIMEOUT="5")
    proc = torchrun(SCRIPTS / "fault_runtime_hang.py", "barrier", env=env, check=False, timeout=120)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0 and "unreachable" not in proc.stdout
    assert elapsed < 60, f"the job took {elapsed:.0f} s to end"
    err = proc.stderr
    assert "[hasten] rank 0 has waited 1 s in collective #" in err and "not arrived: rank 1 (at #" in err, err
    assert "rank 0 has waited 5." in err and "(HASTEN_HANG_TIMEOUT=5) in collective #" in err, err
    assert "of the default process group; rank 1 did not arrive." in err, err
    assert "  - rank 1 did not arrive (its last collective there is #" in err, err
    assert "and waits in no collective: it holds the others up, at " in err, err
    assert "fault_runtime_hang.py:20 in sleep_instead: time.sleep(120)" in err, err
    assert "Stack of rank 1:" in err and "Stack of rank 0:" in err and "dist.barrier()" in err, err


@pytest.mark.serial
@pytest.mark.parametrize("scenario", ["backward", "gather"])
def test_a_hang_is_reported_with_the_rank_that_did_not_arrive_as_the_cause(scenario):
    # Rank 1 sleeps; rank 0 waits in DDP's gradient all-reduce inside accelerator.backward (before: no report, the
    # job ended at the process group's timeout with gloo's error) or in hasten's gather (before: reported, but the
    # launcher's summary blamed rank 0, the one that waited).
    proc = hasten_launch(
        SCRIPTS / "fault_runtime_hang.py", scenario, env=clean_env(HASTEN_HANG_TIMEOUT="5"), check=False, timeout=120
    )
    assert proc.returncode == 1 and "unreachable" not in proc.stdout, proc.stderr
    err = proc.stderr
    inside = ", inside `hasten.runtime.operations.gather`" if scenario == "gather" else ""
    assert f"(HASTEN_HANG_TIMEOUT=5) in collective #10 of the default process group{inside}; rank 1 did not" in err
    call = "gather(torch.ones(1))" if scenario == "gather" else "accelerator.backward(model(torch.ones(2, 4)).sum())"
    failed = [line for line in err.splitlines() if line.startswith("  rank ") and "(local rank" in line]
    assert len(failed) == 2, err
    assert failed[0].endswith(
        "): exit code 1; ended by the hang watchdog after it waited in collective #10 of the default process group"
    ), failed
    assert failed[1].endswith(
        "): stopped by the launcher (SIGTERM); the cause of the hang: it did not arrive at collective #10 of the "
        "default process group"
    ), failed
    summary = err[err.index("hasten launch: the job hung in") :].splitlines()
    assert summary[0] == (
        "hasten launch: the job hung in collective #10 of the default process group: rank 1 did not arrive "
        "(HASTEN_HANG_TIMEOUT=5):"
    ), summary
    assert summary[1] == (
        "  rank 1 did not arrive (its last collective there is #9) and waits in no collective: it holds the others up "
        "(the cause); it was at:"
    ), summary
    script = SCRIPTS / "fault_runtime_hang.py"
    assert [line.strip() for line in summary[2:6]] == [
        f'File "{script}", line 31, in <module>',
        "sleep_instead()",
        f'File "{script}", line 20, in sleep_instead',
        "time.sleep(120)",
    ], summary
    assert summary[6].startswith("  rank 0 waited 5.") and summary[6].endswith(
        f" s in it{inside}; its hang watchdog ended the job; it was at:"
    ), summary
    assert summary[8].strip() == call, summary


def test_after_loop_gather_for_metrics_answers_every_rank_with_every_sample():
    # datasets of 1, 7, 64, 101 x batch sizes 1, 4, 16 x even_batches on/off (and split_batches, dispatch_batches
    # for 1, 7, 101 x 4, 16), concatenated and as a list of batches. Before the fix, n=1 with even_batches=False left
    # rank 0 waiting forever (rank 1's empty gather returned at once): the hang timeout guards the launch.
    proc = torchrun(SCRIPTS / "fault_runtime_gather.py", env=clean_env(HASTEN_HANG_TIMEOUT="30"), timeout=180)
    for rank in (0, 1):
        assert f"rank {rank}: 48 of 48 after-loop gathers hold every sample" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize("launcher", [torchrun, hasten_launch], ids=["torchrun", "hasten-launch"])
def test_oom_on_one_rank_inside_a_ddp_step_recovers_at_the_halved_size(launcher):
    # Rank 0 runs out of memory while rank 1 waits in the step's gradient all-reduce. Before the fix
    # the agreement collective met the all-reduce and gloo aborted both ranks.
    proc = launcher(SCRIPTS / "fault_runtime_oom.py", env=clean_env(HASTEN_HANG_TIMEOUT="60"), timeout=180)
    for rank in (0, 1):
        assert f"rank {rank}: tried [16, 8], ended at batch size 8 after 4 steps" in proc.stdout, (
            proc.stdout + proc.stderr
        )
    assert proc.stdout.count("weights equal across ranks and to the reference") == 2, proc.stdout


@pytest.mark.serial
def test_another_error_inside_the_attempt_ends_the_job_at_once():
    start = time.monotonic()
    proc = torchrun(
        SCRIPTS / "fault_runtime_oom.py", "error", env=clean_env(HASTEN_HANG_TIMEOUT="120"), check=False, timeout=180
    )
    elapsed = time.monotonic() - start
    assert proc.returncode != 0 and "ValueError: a bug in the training step (rank 0 only)" in proc.stderr, proc.stderr
    assert elapsed < 60, f"the job took {elapsed:.0f} s to end"


def test_mismatched_collectives_raise_on_every_process_outside_debug_mode():
    # Before the check, a gather of (10, 4) against (8, 4) aborted one process in gloo and returned a wrong
    # (20, 4) tensor on the other; dtypes that differ returned wrong numbers on both.
    proc = torchrun(SCRIPTS / "fault_runtime_mismatch.py", env=clean_env(HASTEN_HANG_TIMEOUT="60"), timeout=180)
    for rank in (0, 1):
        assert f"rank {rank}: 18 mismatches raised on this rank" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.serial
@pytest.mark.parametrize("launcher", [torchrun, hasten_launch], ids=["torchrun", "hasten-launch"])
def test_a_rank_that_left_the_loop_is_named_in_its_peers_error(launcher):
    # Before, rank 0 got gloo's raw "Connection closed by peer" and nothing said which rank had gone.
    start = time.monotonic()
    env = clean_env(HASTEN_HANG_TIMEOUT="60")
    proc = launcher(SCRIPTS / "fault_runtime_leave.py", env=env, check=False, timeout=120)
    err = proc.stderr
    assert proc.returncode != 0 and time.monotonic() - start < 60, err
    assert "rank 1: left the loop after 1 step(s)" in proc.stdout, proc.stdout
    assert "DistributedOperationException: `hasten.runtime.operations.gather` (collective #2) failed" in err, err
    assert "rank 1: exited after collective #1 `gather`" in err, err


_STUCK = {
    "sleep": ["Thread MainThread:", "time.sleep(120)"],
    "busy": ["in spin_in_python"],
    "gil": ["stacks written by faulthandler", "in hold_the_gil"],
    "raw": ["dist.all_reduce(torch.ones(1), group=side_group)"],
    "worker": [
        "in wait_for_a_worker",
        "Child process",
        "a fork of this process (e.g. a DataLoader worker)",
        "in __getitem__",
    ],
}


@pytest.mark.serial
@pytest.mark.parametrize("scenario", list(_STUCK))
def test_the_hang_report_has_the_stack_of_a_rank_stuck_outside_hasten_collectives(scenario, tmp_path):
    # Rank 1 never enters a hasten collective: before, the report said "(no answer ...)" for its stack.
    env = clean_env(HASTEN_HANG_TIMEOUT="4", HASTEN_HANG_REPORT_DIR=str(tmp_path))
    proc = torchrun(SCRIPTS / "fault_runtime_stuck.py", scenario, env=env, check=False, timeout=120)
    assert proc.returncode != 0 and "unreachable" not in proc.stdout, proc.stderr
    (written,) = tmp_path.glob("hang_rank*.json")  # raw: rank 1 waits too (a deadlock), and may report first
    report = json.loads(written.read_text())
    assert "rank 1 did not arrive (its last collective there is #0)" in report["peers"] or (
        scenario == "raw"
        and "rank 0 did not arrive (its last collective there is #0): it waits itself" in report["peers"]
    ), report
    assert report["peer_stacks"] in proc.stderr, f"the report lacks the other ranks' stacks: {report}"
    rank1 = report["stack"] if report["rank"] == 1 else report["peer_stacks"].split("Stack of rank 1:", 1)[1]
    missing = [fragment for fragment in _STUCK[scenario] if fragment not in rank1]
    assert not missing, f"missing {missing} in rank 1's stack:\n{rank1}"
