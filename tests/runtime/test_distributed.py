"""Behaviour across 2 real processes over gloo, each launch checking many things (see tests/scripts/)."""

import pytest
from helpers import SCRIPTS, clean_env, hasten_launch, torchrun

pytestmark = pytest.mark.slow


def test_data_loading_two_processes():
    assert "data loading checks passed" in torchrun(SCRIPTS / "check_data_loading.py").stdout


def test_collectives_two_processes():
    out = torchrun(SCRIPTS / "check_collectives.py").stdout
    assert "collective checks passed" in out
    ordered = [line for line in out.splitlines() if line.startswith("ORDERED")]
    assert ordered == [f"ORDERED round {i} rank {r}" for i in range(3) for r in range(2)], ordered
    assert out.count("MAIN ONLY") == 1


def test_training_two_processes():
    out = torchrun(SCRIPTS / "check_training.py").stdout
    assert "rank 0: training checks passed" in out and "rank 1: training checks passed" in out


# The time limits bound the runs: a mismatch that were not detected at once would wait for the hang timeout (300 s by
# default) and pass the 60 s limit; the ranks' start-up alone takes 5 to 30 s on a busy 2-core machine.


def test_debug_mode_reports_shape_mismatch_under_torchrun():
    proc = torchrun(
        SCRIPTS / "check_debug_mode.py", "shapes", env=clean_env(HASTEN_DEBUG_MODE="1"), check=False, timeout=60
    )
    assert proc.returncode != 0
    assert "Operation: `hasten.runtime.operations.broadcast`" in proc.stderr
    assert "Process 0: [1, 5]" in proc.stderr and "Process 1: [1, 2, 5]" in proc.stderr
    assert "unreachable" not in proc.stdout


@pytest.mark.serial
def test_debug_mode_names_a_rank_that_skipped_a_collective():
    proc = torchrun(
        SCRIPTS / "check_debug_mode.py",
        "skip",
        env=clean_env(HASTEN_DEBUG_MODE="1", HASTEN_HANG_TIMEOUT="3"),
        check=False,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "rank 0 has waited" in proc.stderr and "inside `hasten.runtime.operations.gather`" in proc.stderr
    assert "rank 1 did not arrive" in proc.stderr and "time.sleep(60)" in proc.stderr, proc.stderr


def test_hasten_launch_debug_reports_shape_mismatch():
    proc = hasten_launch(
        SCRIPTS / "check_debug_mode.py",
        "shapes",
        launch_args=("--debug", "--num_processes", "2"),
        check=False,
        timeout=60,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert "Process 0: [1, 5]" in output and "Process 1: [1, 2, 5]" in output, output


@pytest.mark.serial
def test_hasten_launch_debug_summarises_the_stuck_rank():
    proc = hasten_launch(
        SCRIPTS / "check_debug_mode.py",
        "skip",
        launch_args=("--debug", "--num_processes", "2"),
        env=clean_env(HASTEN_HANG_TIMEOUT="3"),
        check=False,
        timeout=60,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert "rank 0 has waited" in output, output
    assert "the job hung in collective #3 of the default process group: rank 1 did not arrive" in output, output
    assert "rank 0 waited 3.0 s in it, inside `hasten.runtime.operations.gather`" in output, output
