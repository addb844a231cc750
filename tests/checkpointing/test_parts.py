"""Random states a late process adds to a published checkpoint (``hasten_part_<rank>.json``): read and verified
with the checkpoint, ignored when they belong to an earlier save, and owned by hasten when the folder is replaced.
The two-process behaviour (a process that comes after the main process wrote its files) is tested by
``tests/scripts/check_main_only_save.py``."""

import json

import pytest
import torch

from hasten import Accelerator
from hasten.checkpointing import CheckpointReader, read_manifest
from hasten.checkpointing.parts import add_random_states, record_name
from hasten.checkpointing.publishing import holds_only_a_checkpoint
from hasten.errors import CheckpointError
from hasten.runtime.rng import capture_rng_states


def _saved(tmp_path):
    accelerator = Accelerator()
    model = torch.nn.Linear(4, 4)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    folder = tmp_path / "ckpt"
    accelerator.save_state(folder)
    return accelerator, folder


def _states(seed: int) -> dict:
    torch.manual_seed(seed)
    meta, tensors = capture_rng_states()
    return {"meta": meta, "tensors": tensors}


def test_a_part_adds_its_random_states_to_the_checkpoint_and_they_are_verified(tmp_path):
    accelerator, folder = _saved(tmp_path)
    states = _states(7)
    add_random_states(folder, read_manifest(folder)["save_id"], 1, states)
    reader = CheckpointReader(folder)
    assert set(reader.parts) == {"random_states_1.json", "random_states_1.safetensors"}
    loaded = reader.load_state("random_states_1")
    assert torch.equal(loaded["tensors"]["torch"], states["tensors"]["torch"])
    assert holds_only_a_checkpoint(folder), "a part's files are the checkpoint's, not the user's"
    accelerator.load_state(folder)  # the part verifies
    data = bytearray((folder / "random_states_1.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (folder / "random_states_1.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="random_states_1.safetensors is corrupt"):
        accelerator.load_state(folder)


def test_a_part_of_an_earlier_save_is_ignored_and_replaced_with_the_folder(tmp_path):
    accelerator, folder = _saved(tmp_path)
    add_random_states(folder, read_manifest(folder)["save_id"], 1, _states(7))
    record = json.loads((folder / record_name(1)).read_text())
    record["save_id"] = "another save"
    (folder / record_name(1)).write_text(json.dumps(record))
    assert CheckpointReader(folder).parts == {}, "a part names the save it belongs to"
    add_random_states(folder, read_manifest(folder)["save_id"], 2, _states(8))
    accelerator.save_state(folder)  # the folder holds only a checkpoint and its parts: replaced whole
    assert not (folder / record_name(2)).exists() and not (folder / "random_states_2.json").exists()
    assert CheckpointReader(folder).parts == {}


def test_a_part_lists_only_its_own_random_states(tmp_path):
    _, folder = _saved(tmp_path)
    add_random_states(folder, read_manifest(folder)["save_id"], 1, _states(7))
    record = json.loads((folder / record_name(1)).read_text())
    record["files"]["model.safetensors"] = {"size": 1, "xxh3_64": ["0"]}
    (folder / record_name(1)).write_text(json.dumps(record))
    reader = CheckpointReader(folder)
    assert set(reader.parts) == {"random_states_1.json", "random_states_1.safetensors"}
    assert reader.files["model.safetensors"] == read_manifest(folder)["files"]["model.safetensors"]
