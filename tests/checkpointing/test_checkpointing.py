"""save_state / load_state: round trips, verification, rotation, no pickle, crash safety, exact resume."""

import json
import os
import pickle
import re
import subprocess
import sys

import pytest
import torch
from helpers import SCRIPTS, clean_env, torchrun
from torch.utils.data import DataLoader, TensorDataset

from hasten import Accelerator, DataLoaderConfiguration
from hasten.checkpointing import MANIFEST, complete_checkpoints
from hasten.errors import CheckpointError, ConfigError
from hasten.state import reset_state
from hasten.utils import ProjectConfiguration, set_seed


class Counter:
    def __init__(self):
        self.value = 0
        self.history = [1.5, (2, "x")]

    def state_dict(self):
        return {"value": self.value, "history": self.history, "weights": torch.arange(3.0)}

    def load_state_dict(self, state):
        self.value, self.history = state["value"], state["history"]
        assert torch.equal(state["weights"], torch.arange(3.0))


def build(acc, mixed=False):
    set_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=100)
    dl = DataLoader(TensorDataset(torch.randn(40, 4), torch.randn(40, 1)), batch_size=4, shuffle=True)
    return acc.prepare(model, opt, dl, sched)


def train(acc, model, opt, dl, sched, epochs, save_at=None, path=None):
    losses = []
    for epoch in range(dl.iteration, epochs):
        for i, (x, y) in enumerate(dl):
            loss = torch.nn.functional.mse_loss(model(x), y)
            acc.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            losses.append(loss.item())
            if (epoch, i) == save_at:
                acc.save_state(path)
                losses.clear()
    return losses


def test_default_load_state_lets_the_loop_skip_what_it_trained_on(tmp_path):
    # diffusers' resume: `if step < resume_step: continue`. load_state must not also move the loader (Accelerate).
    acc = Accelerator()
    objects = build(acc)
    expected = train(acc, *objects, epochs=2, save_at=(1, 5), path=tmp_path / "ckpt")
    final = [p.detach().clone() for p in objects[0].parameters()]
    reset_state()
    acc = Accelerator()
    model, opt, dl, sched = build(acc)
    acc.load_state(tmp_path / "ckpt")
    assert dl.iteration == 1, "the saved epoch (and its shuffling order) comes back"
    losses = []
    for step, (x, y) in enumerate(dl):
        if step <= 5:
            continue
        loss = torch.nn.functional.mse_loss(model(x), y)
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses == expected and len(losses) == 4
    assert all(torch.equal(a, b) for a, b in zip(final, model.parameters()))


def test_round_trip_resumes_exactly_with_fp16_and_custom_objects(tmp_path):
    stateful = DataLoaderConfiguration(use_stateful_dataloader=True)
    acc = Accelerator(mixed_precision="fp16", dataloader_config=stateful)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    objects = build(acc)
    counter.value = 7
    expected = train(acc, *objects, epochs=2, save_at=(0, 4), path=tmp_path / "ckpt")
    final = [p.detach().clone() for p in objects[0].parameters()]
    scale = acc.scaler.get_scale()
    reset_state()
    acc = Accelerator(mixed_precision="fp16", dataloader_config=stateful)
    restored = Counter()
    acc.register_for_checkpointing(restored)
    objects = build(acc)
    acc.load_state(tmp_path / "ckpt")
    assert restored.value == 7 and restored.history == [1.5, (2, "x")]
    assert train(acc, *objects, epochs=2) == expected
    assert all(torch.equal(a, b) for a, b in zip(final, objects[0].parameters()))
    assert acc.scaler.get_scale() == scale
    names = set(json.loads((tmp_path / "ckpt" / MANIFEST).read_text())["files"])
    assert {
        "model.safetensors",
        "optimizer.json",
        "optimizer.safetensors",
        "scheduler.json",
        "scaler.json",
        "dataloaders.json",
        "custom_checkpoint_0.json",
        "random_states_0.json",
    } <= names
    assert not any(name.endswith((".bin", ".pt", ".pkl")) for name in os.listdir(tmp_path / "ckpt")), "no pickles"


def test_corrupt_truncated_and_missing_files_are_named(tmp_path):
    acc = Accelerator()
    build(acc)
    acc.save_state(tmp_path / "c")
    model_file = tmp_path / "c" / "model.safetensors"
    data = bytearray(model_file.read_bytes())
    data[-3] ^= 0xFF
    model_file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model.safetensors is corrupt: its checksum"):
        acc.load_state(tmp_path / "c")
    model_file.write_bytes(bytes(data[:-10]))
    with pytest.raises(CheckpointError, match=r"model.safetensors is truncated or corrupt"):
        acc.load_state(tmp_path / "c")
    model_file.unlink()
    with pytest.raises(CheckpointError, match="is missing 'model.safetensors'"):
        acc.load_state(tmp_path / "c")
    (tmp_path / "c" / MANIFEST).unlink()
    with pytest.raises(CheckpointError, match="not a complete hasten checkpoint"):
        acc.load_state(tmp_path / "c")


def test_automatic_naming_rotation_and_latest(tmp_path):
    acc = Accelerator(
        project_config=ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2)
    )
    model, opt, dl, sched = build(acc)
    for _ in range(4):
        acc.save_state()
    assert [i for i, _ in complete_checkpoints(tmp_path)] == [2, 3]
    assert acc.save_iteration == 4
    (tmp_path / "checkpoints" / "checkpoint_9").mkdir()
    with pytest.warns(UserWarning, match="checkpoint_9"):
        assert acc.load_state().endswith("checkpoint_3")
    assert acc.save_iteration == 4
    with pytest.raises(CheckpointError, match="already exists"):
        acc.project_configuration.iteration = 3
        acc.save_state()


def test_save_state_errors_are_clear(tmp_path):
    acc = Accelerator()
    with pytest.raises(ConfigError, match="needs an output_dir"):
        acc.save_state()
    with pytest.raises(
        ValueError, match=r"these have not: Item at index 0, `object`; Item at index 2, `Tensor`\. Wrap"
    ):
        acc.register_for_checkpointing(object(), torch.optim.SGD([torch.zeros(1, requires_grad=True)]), torch.zeros(1))
    build(acc)
    acc.save_state(tmp_path / "a")
    reset_state()
    other = Accelerator()
    with pytest.raises(CheckpointError, match="holds 1 models but this run prepared 0"):
        other.load_state(tmp_path / "a")


class _Exploit:
    def __init__(self, target):
        self.target = target

    def __reduce__(self):
        return (open, (self.target, "w"))


def test_pickles_in_a_checkpoint_folder_never_run(tmp_path):
    acc = Accelerator()
    build(acc)
    acc.save_state(tmp_path / "c")
    marker = tmp_path / "pwned"
    for name in ("optimizer.bin", "random_states_0.pkl"):
        (tmp_path / "c" / name).write_bytes(pickle.dumps(_Exploit(str(marker))))
    acc.load_state(tmp_path / "c")
    assert not marker.exists()


def test_save_and_load_hooks(tmp_path):
    acc = Accelerator()
    model, *_ = build(acc)
    seen = {}

    def save_hook(models, weights, output_dir):
        seen["save"] = (len(models), sorted(weights[0]))
        torch.save({k: v for k, v in weights.pop().items()}, os.path.join(output_dir, "own_format.pt"))

    def load_hook(models, input_dir):
        seen["load"] = input_dir
        models.pop()

    handle = acc.register_save_state_pre_hook(save_hook)
    acc.register_load_state_pre_hook(load_hook)
    acc.save_state(tmp_path / "h")
    assert seen["save"] == (1, ["0.bias", "0.weight", "2.bias", "2.weight"])
    assert not (tmp_path / "h" / "model.safetensors").exists() and (tmp_path / "h" / "own_format.pt").exists()
    acc.load_state(tmp_path / "h")
    assert seen["load"] == str(tmp_path / "h")
    handle.remove()
    assert not acc._save_hooks


@pytest.mark.slow
def test_sigkill_during_save_never_leaves_an_unloadable_checkpoint(tmp_path):
    out = _run_script(SCRIPTS / "crash_saver.py", str(tmp_path), "20")
    match = re.search(r"(\d+) killed during the save, (\d+) completed, every load whole", out)
    assert match and int(match.group(1)) == 20, out


def _run_script(script, *args) -> str:
    proc = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=300, env=clean_env()
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.slow
def test_main_only_save_under_ddp_and_manual_skip_resume_on_two_processes(tmp_path):
    # diffusers: `if accelerator.is_main_process: accelerator.save_state(path)`, then a resume that skips by hand.
    full = torchrun(SCRIPTS / "check_main_only_save.py", "full", str(tmp_path), timeout=300).stdout
    print(full)  # each save's time: none waits for the other process
    assert "rank 0: full run done" in full and "rank 1: full run done" in full
    resumed = torchrun(SCRIPTS / "check_main_only_save.py", "resume", str(tmp_path), timeout=300).stdout
    assert "rank 0: resume matches with both skips" in resumed and "rank 1: resume matches with both skips" in resumed


@pytest.mark.slow
def test_main_only_save_under_fsdp_is_a_clear_error_on_two_processes(tmp_path):
    out = torchrun(SCRIPTS / "check_main_only_save.py", "sharded", str(tmp_path), timeout=300).stdout
    assert "rank 0: sharded refusal and save done" in out and "rank 1: sharded refusal and save done" in out


@pytest.mark.slow
def test_exact_resume_across_two_processes(tmp_path):
    full = torchrun(SCRIPTS / "check_resume.py", "full", str(tmp_path)).stdout
    resumed = torchrun(SCRIPTS / "check_resume.py", "resume", str(tmp_path)).stdout
    assert "rank 0: resume matches" in resumed and "rank 1: resume matches" in resumed, full + resumed


def test_accelerate_only_keyword_arguments_are_named_not_silently_dropped(tmp_path):
    acc = Accelerator()
    build(acc)
    with pytest.warns(UserWarning, match=r"save_state\(\) ignores \{'save_model_func_kwargs': \['max_shard_size'\]\}"):
        acc.save_state(tmp_path / "k", max_shard_size="1GB")
    with pytest.warns(
        UserWarning,
        match=r"load_state\(\) ignores .*'load_kwargs': \['map_location'\].*'load_model_func_kwargs': \['strict'\]",
    ):
        acc.load_state(tmp_path / "k", load_kwargs={"map_location": "cpu"}, strict=False)
