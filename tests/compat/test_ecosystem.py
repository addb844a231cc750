"""Libraries built on Accelerate, run on hasten.

The venv ``make`` builds is an Accelerate environment answered by hasten: hasten's ``accelerate`` distribution is
installed, and peft, trl, diffusers, sentence-transformers and setfit with it, with their own requirements. The first
tests check that (``pip check``, plain imports). The others launch ``hasten launch --as_accelerate --cpu
--num_processes 2``, the way for environments without that distribution (it changes nothing where it is
installed): ``eco_transformers.py`` (transformers ``Trainer`` with accumulation, eval, ``save_total_limit`` and
resume; ``from_pretrained(device_map="auto")``; a peft LoRA loop) and ``eco_diffusers.py`` (a diffusers-style loop
that saves on the main process only and resumes with the manual skip). Each process of a launch writes one JSON
result per part, read by the tests below.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from helpers import ROOT, SCRIPTS, clean_env, free_port, requires

LAUNCH = ("--as_accelerate", "--cpu", "--num_processes", "2", "-q")


def _launch(script, *args, timeout: float) -> str:
    """Run ``script`` under ``hasten launch`` (its own process group, killed whole on timeout); returns its output."""
    cmd = [
        sys.executable,
        "-m",
        "hasten.commands.main",
        "launch",
        *LAUNCH,
        "--main_process_port",
        str(free_port()),
        str(script),
        *map(str, args),
    ]
    with subprocess.Popen(
        cmd,
        env=clean_env(),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    ) as proc:
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            output += f"\n[killed after {timeout} s]"
    return output


def _results(out, output: str, part: str) -> list[dict]:
    """Both processes' results for ``part``; fails with the launch's output when one is missing or not ok."""
    results = []
    for rank in (0, 1):
        path = out / f"{part}_rank{rank}.json"
        assert path.is_file(), f"process {rank} wrote no result for {part}:\n{output[-6000:]}"
        result = json.loads(path.read_text())
        assert result["ok"], f"{part} failed on process {rank}:\n{result['error']}"
        results.append(result)
    return results


def _alias_version() -> str:
    """The version of the accelerate distribution installed in this venv, as a plain process sees it."""
    code = "import importlib.metadata as m; print(m.version('accelerate'))"
    return _run_plain([sys.executable, "-c", code], timeout=60).stdout.strip()


def _run_plain(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run ``cmd`` in this venv as a user has it: no PYTHONPATH but this checkout's src (the one under test)."""
    env = clean_env(PYTHONPATH=str(ROOT / "src"))
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)


@requires("accelerate alias")
def test_pip_finds_every_requirement_met():
    """peft, trl, sentence-transformers and setfit require the accelerate distribution: hasten's meets it."""
    proc = _run_plain([sys.executable, "-m", "pip", "check"], timeout=300)
    assert (proc.returncode, proc.stdout.strip()) == (0, "No broken requirements found."), proc.stdout + proc.stderr


@requires("accelerate alias", "transformers", "peft", "trl", "diffusers", "sentence_transformers", "setfit")
def test_plain_imports_of_every_library_get_hasten_as_accelerate():
    version = _alias_version()
    code = """
import importlib.metadata, json
import transformers, peft, trl, diffusers, sentence_transformers, setfit
from transformers import Trainer
from sentence_transformers.util import is_training_available
import accelerate, hasten
print(json.dumps({"alias": accelerate.Accelerator is hasten.Accelerator,
                  "distribution": importlib.metadata.version("accelerate"),
                  "trainer_available": transformers.utils.is_accelerate_available(),
                  "sentence_transformers_trains": is_training_available()}))
"""
    proc = _run_plain([sys.executable, "-c", code], timeout=300)
    assert proc.returncode == 0, proc.stderr[-6000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    expected = {"alias": True, "distribution": version, "trainer_available": True, "sentence_transformers_trains": True}
    assert result == expected


@pytest.fixture(scope="module")
def transformers_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("eco_transformers")
    return out, _launch(SCRIPTS / "eco_transformers.py", out, "trainer", "device_map", "peft", timeout=420)


@pytest.mark.slow
@requires("transformers", "peft")
def test_trainer_accumulates_evaluates_rotates_and_resumes_to_the_same_weights(transformers_run):
    for result in _results(*transformers_run, "trainer"):
        assert (
            result["accelerate_version"] == "1.15.0" and result["accelerator_class"] == "hasten.accelerator.Accelerator"
        )
        assert result["devices"] == ["cpu:0", "cpu:0"]  # Accelerate's device of a multi-process CPU job
        assert (result["stopped_at"], result["global_step"], result["straight_global_step"]) == (8, 12, 12)
        assert result["resumed_steps_logged"] == [9, 10, 11, 12]
        assert result["eval_steps"] == {"straight": [4, 8, 12], "resumed": [4, 8, 12]}
        assert result["checkpoints"] == ["checkpoint-12", "checkpoint-8"]  # save_total_limit=2
        assert result["eval_loss_diff"] == 0.0 and result["loss_diff_after_resume"] == 0.0
        assert result["weights_equal"] and result["weights_max_abs_diff"] == 0.0


@pytest.mark.slow
@requires("transformers", "peft")
def test_from_pretrained_with_device_map_auto(transformers_run):
    for result in _results(*transformers_run, "device_map"):
        assert result["devices"] and result["logits_max_abs_diff"] == 0.0


@pytest.mark.slow
@requires("transformers", "peft")
def test_peft_lora_trains_the_adapter_only_and_in_sync(transformers_run):
    for result in _results(*transformers_run, "peft"):
        assert result["trainable"] == 4 and result["lora_b_norm"] > 0  # lora_B starts at zero
        assert result["frozen_max_abs_diff"] == 0.0 and result["ranks_agree"]
        assert result["loss_after"] < result["loss_before"]
        assert result["reload_logits_max_abs_diff"] == 0.0


@pytest.mark.slow
@requires("diffusers")
def test_diffusers_style_main_only_save_and_manual_skip_resume(tmp_path):
    output = _launch(SCRIPTS / "eco_diffusers.py", tmp_path, timeout=240)
    for result in _results(tmp_path, output, "diffusers"):
        assert (result["interrupted_steps"], result["resumed_from"]) == (7, 5)
        assert result["resumed_trained"] == 7 and result["global_step"] == result["straight_global_step"] == 12
        assert result["checkpoint_has_ema"]  # the hooks registered for accelerate >= 0.16.0 ran
        assert result["weights_equal"] and result["ema_max_abs_diff"] == 0.0
        assert result["moved_from_start"] > 0
