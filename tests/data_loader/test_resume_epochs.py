"""Resuming at an epoch's first, middle and last batch and after it, on 2 real processes: restarts (in the
same process, and a launch whose processes are killed), preemptions, ``skip_first_batches`` and iterable
datasets; every resumed run ends with weights bitwise equal to the uninterrupted one
(``tests/scripts/resume_epochs.py``)."""

import json
import re

import pytest
from helpers import SCRIPTS, hasten_launch, torchrun

from hasten.runtime.preemption import PREEMPTED_EXIT_CODE

SCRIPT = SCRIPTS / "resume_epochs.py"
VARIANTS = ("stateful", "skip", "iterable", "iterable-shard", "iterable-skip")
CHECKPOINTS = ("ckpt_1", "ckpt_6", "ckpt_12", "ckpt_after", "ckpt_13")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A folder holding every variant's uninterrupted final weights and its checkpoints."""
    folder = tmp_path_factory.mktemp("epochs")
    torchrun(SCRIPT, "full", str(folder), timeout=400)
    return folder


def test_every_checkpoint_of_every_variant_resumes_bitwise(trained):
    out = torchrun(SCRIPT, "resume", str(trained), timeout=600).stdout
    resumed = set(re.findall(r"rank (\d): (\S+) resumed from (\S+) \(step \d+\): bitwise equal", out))
    assert resumed == {(str(rank), v, c) for rank in (0, 1) for v in VARIANTS for c in CHECKPOINTS}, out


def test_processes_killed_after_the_epochs_last_checkpoint_restart_into_the_next_epoch(trained):
    # The report's run: save_state() every 4 steps, killed at step 13, restarted from the checkpoint of step 12.
    out = hasten_launch(
        SCRIPT, "crash", str(trained), launch_args=("--num_processes", "2", "--max_restarts", "1"), timeout=400
    ).stdout
    assert out.count("restarted at step 12, epoch 0") == 2, out
    assert out.count("crash at step 13, restart: 24 steps, bitwise equal") == 2, out


def _preempted_chain(folder, signals: str, name: str) -> list[tuple[int, dict]]:
    """Launch until the run ends; returns (step, loader position) of each preemption checkpoint."""
    for _ in range(4):
        result = hasten_launch(SCRIPT, "preempt", str(folder), signals, name, check=False, timeout=300)
        if result.returncode == 0:
            assert result.stdout.count("ends bitwise equal") == 2, result.stdout
            break
        assert result.returncode == PREEMPTED_EXIT_CODE, (result.stdout + result.stderr)[-4000:]
    else:
        raise AssertionError("the preempted run never finished")
    saved = []
    for checkpoint in sorted((folder / name / "checkpoints").iterdir()):
        step = json.loads((checkpoint / "custom_checkpoint_0.json").read_text())["tree"]["step"]
        saved.append((step, json.loads((checkpoint / "dataloaders.json").read_text())[0]))
    return saved


def test_preempted_after_the_last_batch_of_each_epoch(trained):
    saved = _preempted_chain(trained, "10,22", "preempt_last")
    positions = [(step, p["epoch"], p["samples"], p["end_of_epoch"]) for step, p in saved]
    assert positions == [(12, 0, 94, True), (24, 1, 94, True)], positions


def test_preempted_at_the_first_and_a_middle_batch(trained):
    saved = _preempted_chain(trained, "11,16", "preempt_first")
    positions = [(step, p["epoch"], p["samples"], p["end_of_epoch"]) for step, p in saved]
    assert positions == [(13, 1, 8, False), (18, 1, 48, False)], positions
