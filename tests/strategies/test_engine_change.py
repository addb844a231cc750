"""Checkpoints resumed under another engine (strategies/engine_change.py, strategies/deepspeed/other_engines.py).

Two launches of tests/scripts/engine_change.py (the tiny transformer with tied weights, AdamW in two parameter groups,
a LambdaLR schedule, fp32): on 2 processes a DDP and a ZeRO 1/2/3 checkpoint are saved and each resumed under the
other engine on 2, then on 1 process both are resumed under the other engine. After every resume the next 3 steps'
losses, the weights and Adam's moments match a run on the target layout that never stopped within 1e-6 relative, the
learning rate is the same, and the main process alone says in one warning line what did not carry over. Right after
a DDP checkpoint is loaded under ZeRO the fp32 masters and moments are the saved ones bit for bit. The refusals run
without a launch.
"""

import sys
from types import SimpleNamespace

import pytest
import torch
from helpers import SCRIPTS, requires, torchrun

from hasten import Accelerator
from hasten.checkpointing.accelerate_format import open_checkpoint
from hasten.errors import CheckpointError
from hasten.strategies.deepspeed.resharding import read_zero_checkpoint
from hasten.strategies.engine_change import StateByName, fill_from_torch_checkpoint, load_state_by_name

pytestmark = [pytest.mark.slow, requires("deepspeed")]

SCRIPT = SCRIPTS / "engine_change.py"
STAGES = "1,2,3"
RESUMES = ("ddp-to-zero:2", "zero-to-ddp:2")


def _launch(nproc: int, root, *actions: str) -> str:
    out = torchrun(SCRIPT, str(root), STAGES, *actions, nproc=nproc, timeout=600)
    text = out.stdout + out.stderr
    for action in actions:
        for stage in STAGES.split(","):
            for rank in range(nproc):
                engine = "ddp" if action == "save-ddp" else f"zero{stage}"
                assert f"rank {rank}: {action} {engine} passed" in text, text[-4000:]
    return text


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """DDP and ZeRO 1-3 checkpoints of 2 processes, each resumed under the other engine on 2 processes."""
    root = tmp_path_factory.mktemp("engines")
    _launch(2, root, "save-ddp", "save-zero", *RESUMES)
    return SimpleNamespace(root=root)


def test_ddp_on_two_resumes_under_zero_and_zero_on_two_under_ddp_on_one(checkpoints):
    _launch(1, checkpoints.root, *RESUMES)


# ------------------------------------------------------------------------------ without a launch


def _model(**changes) -> torch.nn.Module:
    sys.path.insert(0, str(SCRIPTS))
    try:
        from zero_resharding import TinyTransformer
    finally:
        sys.path.remove(str(SCRIPTS))
    model = TinyTransformer()
    for name, module in changes.items():
        setattr(model, name, module)
    return model


def _empty(reader) -> StateByName:
    return StateByName(stage=2, world_size=2, folder=reader.directory)


def _groups(model) -> list[list[str]]:
    """The names of the launches' two groups: the matrices, then the rest."""
    params = dict(model.named_parameters())
    matrices = [name for name, param in params.items() if param.dim() >= 2]
    return [matrices, [name for name in params if name not in matrices]]


def test_a_torch_checkpoint_of_another_model_is_refused_naming_the_parameter(checkpoints):
    reader = open_checkpoint(checkpoints.root / "ddp_w2", 0, [None])
    model = _model(up=torch.nn.Linear(16, 64))
    with pytest.raises(CheckpointError, match=r"parameter 'up.weight' has shape \(32, 16\) in the checkpoint and"):
        fill_from_torch_checkpoint(_empty(reader), reader, 0, model, _groups(model), "here")
    model = _model(extra=torch.nn.Linear(2, 2))
    with pytest.raises(CheckpointError, match=r"has no parameter 'extra.bias', which the model has"):
        fill_from_torch_checkpoint(_empty(reader), reader, 0, model, _groups(model), "here")
    model = _model()
    with pytest.raises(CheckpointError, match=r"groups of \[5, 5\] parameters, but this run's optimizer has \[10\]"):
        fill_from_torch_checkpoint(_empty(reader), reader, 0, model, [sum(_groups(model), [])], "here")
    groups = _groups(model)
    groups[0][1], groups[0][2] = groups[0][2], groups[0][1]  # the optimizer holds them in another order
    with pytest.raises(CheckpointError, match=r"'exp_avg' saved for parameter 'proj.weight' has shape \(48, 16\)"):
        fill_from_torch_checkpoint(_empty(reader), reader, 0, model, groups, "here")


def test_a_zero_checkpoint_of_another_model_is_refused_naming_the_parameter_and_nothing_changes(checkpoints):
    full = read_zero_checkpoint(checkpoints.root / "zero2_w2")
    model = _model(up=torch.nn.Linear(16, 64))
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(CheckpointError, match=r"parameter 'up.weight' has shape \(32, 16\) in the checkpoint and"):
        load_state_by_name(full, model, [optimizer], "here")
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(CheckpointError, match="holds 2 parameter groups; the optimizer has 1"):
        load_state_by_name(full, model, [optimizer], "here")


def test_load_state_on_one_process_refuses_a_zero_checkpoint_of_another_model(checkpoints):
    accelerator = Accelerator(cpu=True)
    model = _model(extra=torch.nn.Linear(2, 2))
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    loader = torch.utils.data.DataLoader(range(8), batch_size=4)
    model, optimizer, _, _ = accelerator.prepare(model, optimizer, loader, scheduler)  # what the checkpoint holds
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"has no parameter 'extra.bias', which the model has"):
        accelerator.load_state(str(checkpoints.root / "zero3_w2"))
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())
    assert not optimizer.state_dict()["state"]


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
