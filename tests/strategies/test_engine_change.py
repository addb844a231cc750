"""Checkpoints resumed under another engine (strategies/engine_change.py): an optimizer's state by parameter name.

The launches over engines and numbers of processes, and the refusals of another model's or a damaged checkpoint, are
in test_resume_matrix.py (they run on its checkpoints); this test needs none.
"""

import sys

import torch
from helpers import SCRIPTS, requires

from hasten import Accelerator
from hasten.checkpointing.accelerate_format import open_checkpoint
from hasten.strategies.engine_change import StateByName, fill_from_torch_checkpoint, load_state_by_name

pytestmark = requires("deepspeed")  # zero_resharding.py's model comes with its DeepSpeed imports


def _model() -> torch.nn.Module:
    sys.path.insert(0, str(SCRIPTS))
    try:
        from zero_resharding import TinyTransformer
    finally:
        sys.path.remove(str(SCRIPTS))
    return TinyTransformer()


def _empty(reader) -> StateByName:
    return StateByName(stage=2, world_size=2, folder=reader.directory)


def test_sgd_momentum_goes_by_name_from_a_torch_checkpoint_to_the_state_and_back(tmp_path):
    accelerator = Accelerator(cpu=True)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    model(torch.zeros(2, 8, dtype=torch.long)).sum().backward()
    optimizer.step()
    accelerator.save_state(str(tmp_path / "sgd"))
    reader = open_checkpoint(tmp_path / "sgd", 0, [model])
    state = _empty(reader)
    fill_from_torch_checkpoint(state, reader, 0, model, [[name for name, _ in model.named_parameters()]], "here")
    assert set(state.optimizer_state["up.weight"]) == {"momentum_buffer"}
    assert state.param_groups[0]["momentum"] == 0.9
    fresh = _model()
    again = torch.optim.SGD(fresh.parameters(), lr=0.5)
    load_state_by_name(state, fresh, [again], "here")
    saved, loaded = optimizer.state_dict(), again.state_dict()
    assert loaded["param_groups"][0]["momentum"] == 0.9 and loaded["param_groups"][0]["lr"] == 0.1
    for position, entry in saved["state"].items():
        assert torch.equal(loaded["state"][position]["momentum_buffer"], entry["momentum_buffer"])
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters()))
