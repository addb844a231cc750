"""FSDP2 checkpoints across process groups: ``save`` trains, checkpoints at step 10 (sharded and full) and
records steps 11-20; ``resume`` (a new launch) loads each checkpoint into a freshly initialised model and
must reproduce those losses; it then merges the sharded checkpoint with ``merge_fsdp_weights``.

``reshard`` (one process) loads the sharded checkpoint written by two.

Usage: fsdp_resume.py save|resume|reshard FOLDER. Run by tests/strategies/test_fsdp.py; exits non-zero at the first
failure.
"""

import json
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from fsdp_model import batches, loss_fn, make_model
from safetensors.torch import load_file, save_file

from hasten import Accelerator
from hasten.errors import CheckpointError
from hasten.state import reset_state
from hasten.strategies.fsdp.merging import merge_fsdp_weights
from hasten.strategies.fsdp.plugin import FullyShardedDataParallelPlugin as Plugin

MODE, FOLDER = sys.argv[1], Path(sys.argv[2])
STEPS, SAVE_AT = 20, 10
KINDS = ("SHARDED_STATE_DICT", "FULL_STATE_DICT")


def setup(kind, seed):
    acc = Accelerator(fsdp_plugin=Plugin(state_dict_type=kind, transformer_cls_names_to_wrap=["Block"]))
    raw = make_model(seed)
    opt = torch.optim.AdamW(raw.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    model, opt, sched = acc.prepare(raw, opt, sched)
    return acc, model, opt, sched


def train(acc, model, opt, sched, steps):
    losses = []
    for tokens in steps:
        loss = loss_fn(model, tokens)
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def save():
    for kind in KINDS:
        acc, model, opt, sched = setup(kind, seed=0)
        data = batches(STEPS, rank=acc.process_index)
        train(acc, model, opt, sched, data[:SAVE_AT])
        acc.save_state(FOLDER / kind)
        weights = acc.get_state_dict(model)
        expected = train(acc, model, opt, sched, data[SAVE_AT:])
        everyone = [None, None]
        dist.all_gather_object(everyone, expected)
        if acc.is_main_process:
            (FOLDER / f"{kind}.json").write_text(json.dumps(everyone))
            save_file(weights, FOLDER / f"{kind}_weights.safetensors")
        reset_state()
    sharded = sorted(p.name for p in (FOLDER / KINDS[0]).iterdir())
    assert "pytorch_model_fsdp_0" in sharded and "optimizer_fsdp_0" in sharded, sharded
    full = sorted(p.name for p in (FOLDER / KINDS[1]).iterdir())
    assert "model.safetensors" in full and "pytorch_model_fsdp_0" not in full, full


def resume():
    for kind in KINDS:
        acc, model, opt, sched = setup(kind, seed=99)
        acc.load_state(FOLDER / kind)
        weights = acc.get_state_dict(model)
        if acc.is_main_process:
            saved = load_file(FOLDER / f"{kind}_weights.safetensors")
            assert all(torch.equal(weights[k], saved[k]) for k in saved), (
                f"{kind}: the loaded weights are the saved ones"
            )
        losses = train(acc, model, opt, sched, batches(STEPS, rank=acc.process_index)[SAVE_AT:])
        expected = json.loads((FOLDER / f"{kind}.json").read_text())[acc.process_index]
        assert losses == expected, f"{kind}: resumed losses differ\n{losses}\n{expected}"
        reset_state()
    merged = merge_fsdp_weights(FOLDER / KINDS[0], FOLDER / "merged")
    if dist.get_rank() == 0:
        assert [p.name for p in merged] == ["model.safetensors"], merged
        saved = load_file(FOLDER / f"{KINDS[0]}_weights.safetensors")
        plain = make_model(seed=7)
        plain.load_state_dict(load_file(FOLDER / "merged" / "model.safetensors"))
        reference = make_model(seed=7)
        reference.load_state_dict(saved)
        tokens = batches(1)[0][:, :-1]
        assert torch.equal(plain(tokens), reference(tokens)), (
            "merged weights reload into a plain model with equal outputs"
        )
    try:
        merge_fsdp_weights(FOLDER / KINDS[0] / "optimizer_fsdp_0", FOLDER / "bad")
    except CheckpointError as error:
        assert "holds optimizer state" in str(error), error
    else:
        raise AssertionError("merging optimizer shards must be refused")


def check_corruption():
    broken = FOLDER / "corrupt"
    if dist.get_rank() == 0:
        shutil.copytree(FOLDER / KINDS[0], broken)
        shard = broken / "optimizer_fsdp_0" / "__1_0.distcp"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    dist.barrier()
    acc, model, opt, sched = setup(KINDS[0], seed=99)
    try:
        acc.load_state(broken)
    except CheckpointError as error:
        assert "__1_0.distcp is corrupt" in str(error), error
    else:
        raise AssertionError("a corrupt shard must be reported")
    reset_state()


def reshard():
    acc, model, opt, sched = setup(KINDS[0], seed=99)
    acc.load_state(FOLDER / KINDS[0])
    weights = acc.get_state_dict(model)
    saved = load_file(FOLDER / f"{KINDS[0]}_weights.safetensors")
    assert all(torch.equal(weights[k], saved[k]) for k in saved), "a checkpoint of 2 processes loads onto 1"
    assert all(s["exp_avg"].shape == p.shape for p, s in ((p, opt.state[p]) for p in model.parameters())), (
        "optimizer state resharded"
    )
    train(acc, model, opt, sched, batches(2, rank=0))


if MODE == "resume":
    resume()
    check_corruption()
else:
    {"save": save, "reshard": reshard}[MODE]()
print(f"rank {dist.get_rank()}: fsdp {MODE} checks passed")
