"""Accelerate's FSDP helpers on hasten's FSDP2 (2 processes): ``save_fsdp_model``/``save_fsdp_optimizer``
after 4 steps, then ``load_fsdp_model``/``load_fsdp_optimizer`` into a freshly initialised, prepared model
must reproduce the next 4 losses exactly, for full and sharded (DCP and per-rank) state dicts, under
Accelerate's file names.

Usage: fsdp_accelerate_helpers.py FOLDER. Run by tests/strategies/test_fsdp.py; exits non-zero at the first failure.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from fsdp_model import batches, loss_fn, make_model

from hasten import Accelerator
from hasten.errors import CheckpointError
from hasten.state import reset_state
from hasten.strategies.fsdp.checkpoint import load_fsdp_model, load_fsdp_optimizer, save_fsdp_model, save_fsdp_optimizer
from hasten.strategies.fsdp.plugin import FullyShardedDataParallelPlugin as Plugin

FOLDER = Path(sys.argv[1])
VARIANTS = {
    "full": ("FULL_STATE_DICT", True, ["optimizer.bin", "pytorch_model_fsdp.bin"]),
    "dcp": ("SHARDED_STATE_DICT", True, ["optimizer_0", "pytorch_model_fsdp_0"]),
    "per_rank": (
        "SHARDED_STATE_DICT",
        False,
        [
            "optimizer_0_rank0.bin",
            "optimizer_0_rank1.bin",
            "pytorch_model_fsdp_0_rank0.bin",
            "pytorch_model_fsdp_0_rank1.bin",
        ],
    ),
}


def setup(kind, seed):
    acc = Accelerator(fsdp_plugin=Plugin(state_dict_type=kind, transformer_cls_names_to_wrap=["Block"]))
    raw = make_model(seed)
    model, opt = acc.prepare(raw, torch.optim.AdamW(raw.parameters(), lr=1e-2))
    return acc, model, opt


def train(acc, model, opt, data):
    losses = []
    for tokens in data:
        loss = loss_fn(model, tokens)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


for name, (kind, use_dcp, files) in VARIANTS.items():
    folder = FOLDER / name
    acc, model, opt = setup(kind, seed=0)
    data = batches(8, rank=acc.process_index)
    train(acc, model, opt, data[:4])
    plugin = acc.state.fsdp_plugin
    save_fsdp_model(plugin, acc, model, folder, adapter_only=True, use_dcp=use_dcp)
    save_fsdp_optimizer(plugin, acc, opt, model, folder, use_dcp=use_dcp)
    expected = train(acc, model, opt, data[4:])
    assert sorted(p.name for p in folder.iterdir()) == files, (name, sorted(p.name for p in folder.iterdir()))
    reset_state()

    acc, model, opt = setup(kind, seed=99)
    plugin = acc.state.fsdp_plugin
    load_fsdp_model(plugin, acc, model, folder, adapter_only=True, use_dcp=use_dcp)
    load_fsdp_optimizer(plugin, acc, opt, model, folder, adapter_only=True, use_dcp=use_dcp)
    resumed = train(acc, model, opt, data[4:])
    assert resumed == expected, f"{name}: resumed losses differ\n{resumed}\n{expected}"
    try:
        load_fsdp_model(plugin, acc, model, FOLDER / "missing", use_dcp=use_dcp)
    except CheckpointError as error:
        assert "missing" in str(error), error
    else:
        raise AssertionError(f"{name}: loading from an empty folder must be refused")
    reset_state()
    print(f"rank {dist.get_rank()}: {name} losses {expected}")

print(f"rank {dist.get_rank()}: fsdp accelerate helpers checks passed")
