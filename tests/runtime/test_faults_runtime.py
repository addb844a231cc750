"""Runtime faults across 2 real gloo processes: bounded hangs, rank-consistent gathers, OOM recovery inside a step."""

import time

import pytest

from helpers import SCRIPTS, clean_env, hasten_launch, torchrun

pytestmark = pytest.mark.slow


def test_a_hung_collective_ends_the_job_outside_debug_mode():
    start = time.monotonic()
    proc = torchrun(SCRIPTS / "fault_runtime_hang.py", env=clean_env(HASTEN_HANG_TIMEOUT="4"), check=False, timeout=90)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0 and "unreachable" not in proc.stdout
    assert elapsed < 40, f"the job took {elapsed:.0f} s to end"
    err = proc.stderr
    assert "[hasten] rank 0 has waited 1 s in `hasten.runtime.operations.gather` (collective #2)" in err, err
    assert "rank 0 has waited 4." in err and "(HASTEN_HANG_TIMEOUT=4)" in err, err
    assert "rank 1: last entered collective #1 `gather`, status: done" in err, err
    assert "Stack of rank 1:" in err and "time.sleep(120)" in err, err
    assert "Stack of rank 0:" in err and "dist.all_gather" in err, err


def test_after_loop_gather_for_metrics_is_the_dataset_on_every_rank():
    # datasets of 1, 7, 64, 101 x batch sizes 1, 4, 16 x even_batches on/off (and split_batches, dispatch_batches
    # for 1, 7, 101 x 4, 16), concatenated and as a list of batches. Before the fix, n=1 with even_batches=False left rank 0 waiting forever (rank 1's empty
    # gather returned at once): the hang timeout guards the launch.
    proc = torchrun(SCRIPTS / "fault_runtime_gather.py", env=clean_env(HASTEN_HANG_TIMEOUT="30"), timeout=180)
    for rank in (0, 1):
        assert f"rank {rank}: 48 of 48 after-loop gathers exact" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize("launcher", [torchrun, hasten_launch], ids=["torchrun", "hasten-launch"])
def test_oom_on_one_rank_inside_a_ddp_step_recovers_at_the_halved_size(launcher):
    # Rank 0 runs out of memory while rank 1 waits in the step's gradient all-reduce. Before the fix
    # the agreement collective met the all-reduce and gloo aborted both ranks.
    proc = launcher(SCRIPTS / "fault_runtime_oom.py", env=clean_env(HASTEN_HANG_TIMEOUT="60"), timeout=180)
    for rank in (0, 1):
        assert f"rank {rank}: tried [16, 8], ended at batch size 8 after 4 steps" in proc.stdout, proc.stdout + proc.stderr
    assert proc.stdout.count("weights equal across ranks and to the reference") == 2, proc.stdout


def test_another_error_inside_the_attempt_ends_the_job_at_once():
    start = time.monotonic()
    proc = torchrun(SCRIPTS / "fault_runtime_oom.py", "error", env=clean_env(HASTEN_HANG_TIMEOUT="120"), check=False, timeout=180)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0 and "ValueError: a bug in the training step (rank 0 only)" in proc.stderr, proc.stderr
    assert elapsed < 60, f"the job took {elapsed:.0f} s to end"
