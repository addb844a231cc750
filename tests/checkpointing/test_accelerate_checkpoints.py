"""load_state of checkpoints written by Accelerate 1.15 (tests/fixtures/accelerate_checkpoints/, made by
tests/fixtures/make_accelerate_checkpoints.py with the real Accelerate): the run continues as Accelerate's own
continuation did (the same random draws; floats within float32's tolerance, since the fixture's numbers were recorded
on another machine), no pickled code runs, and the next save writes hasten's format."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from accelerate_fixture_models import Counter, build_bin, build_two_models, continue_bin, continue_two_models
from helpers import FIXTURES_ROOT, assert_numbers_match

from hasten import Accelerator
from hasten.checkpointing import MANIFEST
from hasten.checkpointing.accelerate_format import AccelerateCheckpointReader, load_pickle
from hasten.errors import CheckpointError

FIXTURES = FIXTURES_ROOT / "accelerate_checkpoints"


def expected(name):
    return json.loads((FIXTURES / name / "expected.json").read_text())


def test_two_models_resume_like_accelerate(tmp_path):
    acc = Accelerator(cpu=True)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    objects = acc.prepare(*build_two_models())
    torch.manual_seed(123)  # states that load_state must replace
    acc.load_state(str(FIXTURES / "safetensors_two_models"))
    assert acc.step == 0
    assert (counter.value, counter.history, counter.weights.tolist()) == (3, [1.5, (2, "x")], [0.0, 0.0, 0.0])
    assert_numbers_match(continue_two_models(objects, acc.backward), expected("safetensors_two_models"), torch.float32)


def test_bin_weights_resume_like_accelerate_and_next_save_is_hasten_format(tmp_path):
    acc = Accelerator(cpu=True)
    objects = acc.prepare(*build_bin())
    acc.load_state(str(FIXTURES / "bin_single"))
    assert objects[2].scheduler.last_epoch == 2
    want = expected("bin_single")
    assert_numbers_match(
        continue_bin(objects, acc.backward), {k: v for k, v in want.items() if k != "scaler"}, torch.float32
    )
    saved = Path(acc.save_state(str(tmp_path / "next")))
    assert (saved / MANIFEST).is_file() and not list(saved.glob("*.pkl")) and not list(saved.glob("*.bin"))


def test_scaler_state_reads_as_saved():
    reader = AccelerateCheckpointReader(FIXTURES / "bin_single")
    assert reader.exists("scaler.json")
    assert reader.load_state("scaler") == expected("bin_single")["scaler"]


def test_a_checkpoint_of_other_objects_is_refused_by_count(tmp_path):
    acc = Accelerator(cpu=True)
    acc.prepare(*build_bin())
    with pytest.raises(CheckpointError, match="holds 2 models but this run prepared 1"):
        acc.load_state(str(FIXTURES / "safetensors_two_models"))


@pytest.mark.parametrize(("name", "refused"), [("optimizer.bin", "io.open"), ("random_states_0.pkl", "posix.system")])
def test_malicious_pickles_are_refused_without_side_effects(tmp_path, monkeypatch, name, refused):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match=rf"Refused to load .*{name}: its pickle refers to {refused}"):
        load_pickle(FIXTURES / "malicious" / name)
    assert os.listdir(tmp_path) == []


def test_load_state_of_a_malicious_checkpoint_names_the_file_and_runs_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "malicious", folder)
    acc = Accelerator(cpu=True)
    acc.prepare(*build_bin()[:2])
    with pytest.raises(CheckpointError, match=r"random_states_0\.pkl: its pickle refers to posix\.system"):
        acc.load_state(str(folder))
    (folder / "random_states_0.pkl").unlink()
    with pytest.raises(CheckpointError, match=r"optimizer\.bin: its pickle refers to io\.open"):
        acc.load_state(str(folder))
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
