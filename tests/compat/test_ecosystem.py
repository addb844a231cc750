"""Libraries built on Accelerate, run on hasten: ``hasten launch --as_accelerate --cpu --num_processes 2``.

Two launches: ``eco_transformers.py`` (transformers ``Trainer`` with accumulation, eval,
``save_total_limit`` and resume; ``from_pretrained(device_map="auto")``; a peft LoRA loop) and
``eco_diffusers.py`` (a diffusers-style loop that saves on the main process only and resumes with the
manual skip). Each process of a launch writes one JSON result per part, read by the tests below.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys

import pytest

from helpers import ROOT, SCRIPTS, clean_env, free_port

LAUNCH = ("--as_accelerate", "--cpu", "--num_processes", "2", "-q")


def _require(*packages: str) -> None:
    """Skip unless ``packages`` are installed (found, not imported: they import accelerate)."""
    for package in packages:
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"{package} is not installed (`make setup` installs it)")


def _launch(script, *args, timeout: float) -> str:
    """Run ``script`` under ``hasten launch`` (its own process group, killed whole on timeout); returns its output."""
    cmd = [sys.executable, "-m", "hasten.commands.main", "launch", *LAUNCH, "--main_process_port", str(free_port()), str(script), *map(str, args)]
    with subprocess.Popen(cmd, env=clean_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True) as proc:
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


@pytest.mark.parametrize("package", ["peft", "diffusers"])
def test_ecosystem_packages_have_their_requirements_but_accelerate_is_not_installed(package):
    """The Makefile installs peft with --no-deps: everything it requires but accelerate must be there."""
    from packaging.requirements import Requirement

    _require(package)
    unmet = []
    for text in importlib.metadata.requires(package) or []:
        requirement = Requirement(text)
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        if requirement.name == "accelerate":
            continue
        try:
            installed = importlib.metadata.version(requirement.name)
        except importlib.metadata.PackageNotFoundError:
            installed = None
        if installed is None or not requirement.specifier.contains(installed, prereleases=True):
            unmet.append(f"{requirement} (installed: {installed})")
    assert not unmet, f"{package} needs: {unmet}"
    assert importlib.util.find_spec("accelerate") is None, "the accelerate distribution must not be installed: hasten answers under its name"


@pytest.fixture(scope="module")
def transformers_run(tmp_path_factory):
    _require("transformers", "peft")
    out = tmp_path_factory.mktemp("eco_transformers")
    return out, _launch(SCRIPTS / "eco_transformers.py", out, "trainer", "device_map", "peft", timeout=420)


@pytest.mark.slow
def test_trainer_accumulates_evaluates_rotates_and_resumes_to_the_same_weights(transformers_run):
    for result in _results(*transformers_run, "trainer"):
        assert result["accelerate_version"] == "1.15.0" and result["accelerator_class"] == "hasten.accelerator.Accelerator"
        assert (result["stopped_at"], result["global_step"], result["straight_global_step"]) == (8, 12, 12)
        assert result["resumed_steps_logged"] == [9, 10, 11, 12]
        assert result["eval_steps"] == {"straight": [4, 8, 12], "resumed": [4, 8, 12]}
        assert result["checkpoints"] == ["checkpoint-12", "checkpoint-8"]  # save_total_limit=2
        assert result["eval_loss_diff"] == 0.0 and result["loss_diff_after_resume"] == 0.0
        assert result["weights_equal"] and result["weights_max_abs_diff"] == 0.0


@pytest.mark.slow
def test_from_pretrained_with_device_map_auto(transformers_run):
    for result in _results(*transformers_run, "device_map"):
        assert result["devices"] and result["logits_max_abs_diff"] == 0.0


@pytest.mark.slow
def test_peft_lora_trains_the_adapter_only_and_in_sync(transformers_run):
    for result in _results(*transformers_run, "peft"):
        assert result["trainable"] == 4 and result["lora_b_norm"] > 0  # lora_B starts at zero
        assert result["frozen_max_abs_diff"] == 0.0 and result["ranks_agree"]
        assert result["loss_after"] < result["loss_before"]
        assert result["reload_logits_max_abs_diff"] == 0.0


@pytest.mark.slow
def test_diffusers_style_main_only_save_and_manual_skip_resume(tmp_path):
    _require("diffusers")
    output = _launch(SCRIPTS / "eco_diffusers.py", tmp_path, timeout=240)
    for result in _results(tmp_path, output, "diffusers"):
        assert (result["interrupted_steps"], result["resumed_from"]) == (7, 5)
        assert result["resumed_trained"] == 7 and result["global_step"] == result["straight_global_step"] == 12
        assert result["checkpoint_has_ema"]  # the hooks registered for accelerate >= 0.16.0 ran
        assert result["weights_equal"] and result["ema_max_abs_diff"] == 0.0
        assert result["moved_from_start"] > 0


@pytest.mark.slow
def test_transformers_trainer_example_trains_evaluates_and_resumes(tmp_path):
    example = ROOT / "examples" / "transformers_trainer.py"
    first = _launch(example, "--output_dir", tmp_path, timeout=420)
    assert "Trainer runs on hasten (accelerate 1.15.0), 2 process(es)" in first, first[-6000:]
    losses = {int(s): float(v) for s, v in re.findall(r"^step (\d+): loss ([0-9.]+)$", first, re.M)}
    evals = {int(s): float(v) for s, v in re.findall(r"^step (\d+): eval_loss ([0-9.]+)$", first, re.M)}
    assert sorted(losses) == [10, 20, 30, 40] and sorted(evals) == [20, 40], first[-6000:]
    assert losses[40] < losses[10] - 1.0 and evals[40] < 2.8, (losses, evals)  # from ln(256) = 5.5
    second = _launch(example, "--output_dir", tmp_path, "--resume", "--max_steps", "60", timeout=420)
    resumed = {int(s) for s in re.findall(r"^step (\d+): loss ", second, re.M)}
    assert resumed == {50, 60} and "resumed, now at step 60" in second, second[-6000:]
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-60"]  # save_total_limit=1
