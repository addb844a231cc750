"""FSDP2 checkpoints resumed under another engine and back, in one process (strategies/fsdp/other_engines.py).

A one-process run's checkpoint loaded under FSDP2 gets every parameter's saved Adam moments (they were matched by
position in the flat list of FSDP2's optimizer state: a parameter could get another's moments, or none); an FSDP2
checkpoint, sharded or full, loaded without FSDP2 gets them too, bit for bit; a damaged or missing shard is refused
naming the file before anything changes. The launches over engines and process counts are in test_resume_matrix.py.
"""

import pytest
import torch

from hasten import Accelerator
from hasten.errors import CheckpointError
from hasten.state import reset_state
from hasten.strategies.fsdp.plugin import FullyShardedDataParallelPlugin

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class Tied(torch.nn.Module):
    """An embedding whose output projection is the input embedding, a block in between, a buffer."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.up = torch.nn.Linear(8, 12)
        self.down = torch.nn.Linear(12, 8)
        self.head = torch.nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.tensor([0.5]))

    def forward(self, tokens):
        h = self.embed(tokens)
        return self.head(h + self.down(torch.relu(self.up(h))) * self.scale)


TOKENS = torch.randint(0, 16, (6, 4, 5), generator=torch.Generator().manual_seed(0))


def _run(engine: str | None, steps: int, load: str | None = None, save: str | None = None):
    """Train ``steps`` steps under FSDP2 (``"sharded"``/``"full"`` state dicts) or one plain process (None), after
    loading ``load``, then save into ``save``; returns (accelerator, model, optimizer)."""
    reset_state(destroy_process_group=True)  # FSDP2 on one process starts a group of one; the next run makes its own
    plugin = None
    if engine is not None:
        kind = "SHARDED_STATE_DICT" if engine == "sharded" else "FULL_STATE_DICT"
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type=kind)
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    torch.manual_seed(1)
    raw = Tied()
    matrices = [p for p in raw.parameters() if p.dim() >= 2]
    others = [p for p in raw.parameters() if p.dim() < 2]
    groups = [{"params": others, "weight_decay": 0.0}, {"params": matrices, "weight_decay": 0.1}]
    model, optimizer = accelerator.prepare(raw, torch.optim.AdamW(groups, lr=1e-2))
    if load is not None:
        accelerator.load_state(load)
    for tokens in TOKENS[:steps]:
        accelerator.backward(model(tokens).logsumexp(-1).mean())
        optimizer.step()
        optimizer.zero_grad()
    if save is not None:
        accelerator.save_state(save)
    return accelerator, model, optimizer


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _state(accelerator, model, optimizer) -> dict[str, torch.Tensor]:
    """Every parameter's weight and optimizer state (Adam's step and moments), whole, by name."""
    state = {}
    inner = optimizer.optimizer
    for name, param in accelerator.unwrap_model(model).named_parameters():
        state[name] = _full(param.detach()).clone()
        for key, value in inner.state[param].items():
            state[f"{name}:{key}"] = _full(value).clone()
    return state


PAIRS = {
    "one-process-to-fsdp2": (None, "sharded"),
    "fsdp2-sharded-to-one": ("sharded", None),
    "fsdp2-full-to-one": ("full", None),
}


@pytest.mark.parametrize("source,target", PAIRS.values(), ids=PAIRS.keys())
def test_the_saved_weights_and_moments_load_by_name_under_another_engine(tmp_path, source, target):
    saved = _state(*_run(source, 3, save=str(tmp_path / "saved")))
    loaded = _state(*_run(target, 0, load=str(tmp_path / "saved")))
    assert loaded.keys() == saved.keys()
    for key, value in saved.items():
        assert torch.equal(loaded[key], value), key


def _damage(folder, pattern: str, how: str) -> str:
    victim = sorted(folder.glob(pattern))[0]
    if how == "flip":
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
    else:
        victim.unlink()
    return victim.name


@pytest.mark.parametrize("how", ["flip", "remove"])
def test_a_damaged_or_missing_shard_is_refused_by_name_before_anything_changes(tmp_path, how):
    _run("sharded", 2, save=str(tmp_path / "saved"))
    name = _damage(tmp_path / "saved" / "optimizer_fsdp_0", "*.distcp", how)
    accelerator, model, optimizer = _run(None, 0)
    before = _state(accelerator, model, optimizer) if how == "flip" else None
    with pytest.raises(CheckpointError, match=name):
        accelerator.load_state(str(tmp_path / "saved"))
    if before is not None:
        after = _state(accelerator, model, optimizer)
        assert all(torch.equal(after[key], value) for key, value in before.items())


def _two_optimizers(engine: str | None):
    reset_state(destroy_process_group=True)
    plugin = None if engine is None else FullyShardedDataParallelPlugin(fsdp_version=2)
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    model = Tied()
    first = torch.optim.SGD([model.embed.weight], lr=0.1)
    second = torch.optim.SGD(list(model.up.parameters()) + list(model.down.parameters()), lr=0.1)
    accelerator.prepare(model, first, second)
    return accelerator


def test_a_checkpoint_of_another_engine_with_two_optimizers_is_refused_saying_what_to_do(tmp_path):
    _two_optimizers("sharded").save_state(str(tmp_path / "saved"))
    with pytest.raises(CheckpointError, match="prepare one to resume it under another engine"):
        _two_optimizers(None).load_state(str(tmp_path / "saved"))
