"""FSDP x TP checkpoints across process groups (4 processes, dp_shard=2 x tp=2, a tiny LlamaForCausalLM).

``save`` trains 4 steps, saves the state (DCP shards of 2-D DTensors in the atomic checkpoint folder) and
records steps 5-8; ``resume`` (a new launch) loads it into a model built from another seed, must reproduce
those losses, and merges the shards into one safetensors model that a plain model loads with equal outputs.

Usage: parallelism_resume.py save|resume FOLDER. Run by tests/strategies/test_parallelism.py.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from parallelism_training import LOCAL_BATCH, llama_case
from safetensors.torch import load_file, save_file

from hasten import Accelerator, ParallelismConfig
from hasten.state import reset_state
from hasten.strategies.fsdp.merging import merge_fsdp_weights

MODE, FOLDER = sys.argv[1], Path(sys.argv[2])
SAVE_AT, STEPS = 4, 8


def setup(seed):
    make, data, loss_fn = llama_case()
    acc = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=2, tp_size=2))
    raw = make()
    if seed:
        torch.manual_seed(seed)
        with torch.no_grad():
            for parameter in raw.parameters():
                parameter.normal_(0, 0.02)
    model = acc.prepare(raw)
    opt = acc.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
    rank, dp = acc.data_parallel_rank, acc.parallelism_config.data_parallel_size
    x, y = data.tensors
    batches = [
        (x[i : i + LOCAL_BATCH], y[i : i + LOCAL_BATCH]) for i in range(rank * LOCAL_BATCH, len(x), LOCAL_BATCH * dp)
    ]
    return acc, model, opt, loss_fn, batches


def train(acc, model, opt, loss_fn, batches):
    losses = []
    for x, y in batches:
        loss = loss_fn(model, x, y)
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


if MODE == "save":
    acc, model, opt, loss_fn, batches = setup(0)
    train(acc, model, opt, loss_fn, batches[:SAVE_AT])
    acc.save_state(FOLDER / "checkpoint")
    weights = acc.get_state_dict(model)
    expected = train(acc, model, opt, loss_fn, batches[SAVE_AT:STEPS])
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, expected)
    if acc.is_main_process:
        (FOLDER / "losses.json").write_text(json.dumps(everyone))
        save_file(weights, FOLDER / "weights.safetensors")
else:
    acc, model, opt, loss_fn, batches = setup(5)
    acc.load_state(FOLDER / "checkpoint")
    losses = train(acc, model, opt, loss_fn, batches[SAVE_AT:STEPS])
    expected = json.loads((FOLDER / "losses.json").read_text())[acc.process_index]
    assert losses == expected, f"resumed losses differ\n{losses}\n{expected}"
    merged = merge_fsdp_weights(FOLDER / "checkpoint", FOLDER / "merged")
    if acc.is_main_process:
        saved = load_file(FOLDER / "weights.safetensors")
        make, data, _ = llama_case()
        plain, reference = make(), make()
        plain.load_state_dict(load_file(FOLDER / "merged" / "model.safetensors"))
        reference.load_state_dict(saved)
        x = data.tensors[0][:4]
        assert torch.equal(plain(input_ids=x).logits, reference(input_ids=x).logits), (
            "merged weights reload into a plain model"
        )
reset_state()
print(f"rank {dist.get_rank()}: parallelism {MODE} checks passed")
