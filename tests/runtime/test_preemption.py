"""Preemption with real processes: a signal to ``hasten launch`` mid-training saves one checkpoint at the
same step on every rank, the launcher exits in time with code 75, and the relaunch resumes exactly."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from helpers import ROOT, SCRIPTS, clean_env, free_port, hasten_launch
from safetensors.torch import load_file

from hasten.runtime.preemption import PREEMPTED_EXIT_CODE

SCRIPT = SCRIPTS / "preempt_train.py"
pytestmark = pytest.mark.slow  # signals go to this test's own launch only: it runs beside other tests


def _launch_cmd(folder: Path, *script_args: str, launch_args: tuple[str, ...] = ()) -> list[str]:
    return [
        sys.executable, "-m", "hasten.commands.main", "launch", "--num_processes", "2",
        "--main_process_port", str(free_port()),
        *launch_args, str(SCRIPT), str(folder), *script_args,
    ]  # fmt: skip


def _interrupt(
    folder: Path,
    sig: signal.Signals,
    *script_args: str,
    launch_args: tuple[str, ...] = (),
    env: dict | None = None,
    one_worker: bool = False,
):
    """Start a launch, send ``sig`` to the launcher (or to its last worker only) after 4 optimizer steps;
    returns (process result, seconds from the signal to the launcher's exit)."""
    folder.mkdir(parents=True, exist_ok=True)
    process = subprocess.Popen(
        _launch_cmd(folder, *script_args, launch_args=launch_args), cwd=ROOT, env=env or clean_env(),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        progress = folder / "progress"
        while not (progress.is_file() and progress.read_text().strip() and int(progress.read_text()) >= 4):
            if process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"training never reached step 4:\n{process.communicate()[1][-4000:]}")
            time.sleep(0.05)
        start = time.monotonic()
        if one_worker:
            psutil.Process(process.pid).children()[-1].send_signal(sig)
        else:
            process.send_signal(sig)
        out, err = process.communicate(timeout=60)
        elapsed = time.monotonic() - start
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    return subprocess.CompletedProcess(process.args, process.returncode, out, err), elapsed


def _stopped_steps(output: str) -> dict[int, int]:
    return {int(rank): int(step) for rank, step in re.findall(r"rank (\d) stopped after step (\d+)", output)}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, torch.Tensor]:
    """Final weights of the training run without any signal."""
    folder = tmp_path_factory.mktemp("full")
    hasten_launch(SCRIPT, str(folder), launch_args=("--num_processes", "2"))
    return load_file(str(folder / "final.safetensors"))


def _assert_same_weights(expected: dict[str, torch.Tensor], folder: Path) -> None:
    got = load_file(str(folder / "final.safetensors"))
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), name


def test_sigterm_saves_at_the_same_step_and_resumes_bitwise(tmp_path, uninterrupted):
    result, elapsed = _interrupt(tmp_path / "cut", signal.SIGTERM)
    log = result.stdout + result.stderr
    assert result.returncode == PREEMPTED_EXIT_CODE, log[-4000:]
    assert elapsed < 30, f"launcher took {elapsed:.1f} s to exit"
    steps = _stopped_steps(log)
    assert set(steps) == {0, 1} and steps[0] == steps[1], log[-4000:]
    checkpoints = sorted((tmp_path / "cut" / "checkpoints").iterdir())
    assert [c.name for c in checkpoints] == ["checkpoint_0"], checkpoints
    assert (checkpoints[0] / "random_states_0.safetensors").is_file() and (
        checkpoints[0] / "random_states_1.safetensors"
    ).is_file()
    assert f"all 2 process(es) saved {checkpoints[0]} after optimizer step {steps[0]}; exit code 75" in result.stderr

    resumed = hasten_launch(SCRIPT, str(tmp_path / "cut"), launch_args=("--num_processes", "2"))
    assert resumed.stdout.count(f"resumed at step {steps[0]}") == 2, resumed.stdout
    _assert_same_weights(uninterrupted, tmp_path / "cut")


def test_save_at_the_end_of_an_epoch_resumes_bitwise(tmp_path, uninterrupted):
    # Signalled after step 6 of an 8-step epoch, the ranks agree on step 7 or 8; at 8 the save waits for
    # the next epoch's first batch request, when the loop's epoch counter and the loader agree.
    cut = tmp_path / "cut"
    result = hasten_launch(
        SCRIPT, str(cut), "--signal-launcher-at", "6", launch_args=("--num_processes", "2"), check=False
    )
    assert result.returncode == PREEMPTED_EXIT_CODE, (result.stdout + result.stderr)[-4000:]
    steps = _stopped_steps(result.stdout)
    assert steps[0] == steps[1] in (7, 8), result.stdout
    resumed = hasten_launch(SCRIPT, str(cut), launch_args=("--num_processes", "2"))
    assert resumed.stdout.count(f"resumed at step {steps[0]}") == 2 and "stopped after step 24" in resumed.stdout, (
        resumed.stdout
    )
    _assert_same_weights(uninterrupted, cut)


def test_sigusr1_with_accumulation_requeues_under_slurm(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "scontrol_calls"
    fake = bin_dir / "scontrol"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    fake.chmod(0o755)
    env = clean_env(SLURM_JOB_ID="4242")
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    result, elapsed = _interrupt(
        tmp_path / "run", signal.SIGUSR1, "--accumulate", launch_args=("--requeue_on_preemption",), env=env
    )
    log = result.stdout + result.stderr
    assert result.returncode == PREEMPTED_EXIT_CODE, log[-4000:]
    assert elapsed < 30
    steps = _stopped_steps(log)
    assert set(steps) == {0, 1} and steps[0] == steps[1], log[-4000:]
    assert "preempted by SIGUSR1" in result.stderr
    assert calls.read_text().split() == ["requeue", "4242"]
    assert "Slurm job 4242 requeued." in result.stderr


def test_signal_to_one_worker_reaches_the_other_through_the_store(tmp_path):
    result, elapsed = _interrupt(tmp_path / "run", signal.SIGTERM, one_worker=True)
    log = result.stdout + result.stderr
    assert result.returncode == PREEMPTED_EXIT_CODE, log[-4000:]
    assert elapsed < 30
    assert log.count("SIGTERM received") == 1, log[-4000:]
    steps = _stopped_steps(log)
    assert set(steps) == {0, 1} and steps[0] == steps[1], log[-4000:]
    assert "process(es) failed" not in result.stderr, result.stderr[-4000:]
    assert [c.name for c in (tmp_path / "run" / "checkpoints").iterdir()] == ["checkpoint_0"]


def test_without_project_folder_the_signal_ends_the_job_with_a_hint(tmp_path):
    result, elapsed = _interrupt(tmp_path / "run", signal.SIGTERM, "--no-project")
    assert result.returncode == 128 + signal.SIGTERM, result.stderr[-4000:]
    assert elapsed < 30
    hint = (
        "SIGTERM received; the job stops without a checkpoint. To save one and resume after a preemption, give the "
        "Accelerator"
    )
    assert result.stderr.count(hint) == 1, result.stderr[-4000:]
    assert "automatic_checkpoint_naming=True" in result.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()
