"""Saving on N processes and resuming on M: no sample repeated or skipped, models and optimizers loaded.

``resume_world_size.py save FOLDER`` (run on N processes) trains each loader variant for 3 steps of an epoch
of 50 samples (stateful loaders), records the samples every process trained on and saves into
``FOLDER/<N>/<variant>``; under FSDP (sharded state dict) it also saves the full weights beside.
``resume FOLDER N`` (run on M processes) loads each of those checkpoints, finishes the epoch and checks
on the main process that the samples seen before and after the resume make the epoch exactly once
each; FSDP's weights come back equal to the saved ones and its optimizer state fits the new shards.

Variants: ``even`` (batch 4 per process; the last round is padded, padding is not counted), ``uneven``
(``even_batches=False``), ``split`` (``split_batches=True``, global batch 8), ``iterable`` (rank 0 reads
and dispatches) and ``iterable-shard`` (every process reads, ``dispatch_batches=False``).
"""

import json
import sys
import warnings
from collections import Counter
from pathlib import Path

import torch
from fsdp_model import batches, loss_fn, make_model
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from hasten import Accelerator, DataLoaderConfiguration, PartialState
from hasten.runtime.operations import gather_object
from hasten.state import reset_state
from hasten.strategies.fsdp.plugin import FullyShardedDataParallelPlugin
from hasten.utils import set_seed

MODE, FOLDER = sys.argv[1], Path(sys.argv[2])
SAMPLES, STEPS = 50, 3
DATA = torch.cat(
    [
        torch.arange(SAMPLES, dtype=torch.float32)[:, None],
        torch.randn(SAMPLES, 3, generator=torch.Generator().manual_seed(1)),
    ],
    dim=1,
)
VARIANTS = {
    "even": ({}, 4),
    "uneven": ({"even_batches": False}, 4),
    "split": ({"split_batches": True}, 8),
    "iterable": ({}, 4),
    "iterable-shard": ({"dispatch_batches": False}, 4),
}


class Stream(IterableDataset):
    def __iter__(self):
        return iter(DATA)


def setup(variant):
    options, batch_size = VARIANTS[variant]
    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True, **options))
    set_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = (
        DataLoader(Stream(), batch_size=batch_size)
        if variant.startswith("iterable")
        else DataLoader(TensorDataset(DATA), batch_size=batch_size, shuffle=True)
    )
    model, optimizer, loader = accelerator.prepare(model, optimizer, data)
    return accelerator, model, optimizer, loader


def real_rows(loader, batch, rank):
    """The sample indices of ``batch`` that are not padding (the last round's layout says which are)."""
    rows = batch[:, 0].long().tolist()
    final = loader.final_round
    if loader.end_of_dataloader and final is not None and final.padded:
        rows = rows[: min(max(final.real - sum(final.sizes[:rank]), 0), final.sizes[rank])]
    return rows


def train(accelerator, model, optimizer, loader, steps=None):
    """Train until ``steps`` steps (None: the end of the epoch); returns the samples this process trained on."""
    seen = []
    with accelerator.join_uneven_inputs([model]):  # even_batches=False: a process may get one batch fewer
        for step, batch in enumerate(loader):
            batch = batch if torch.is_tensor(batch) else batch[0]
            accelerator.backward(model(batch).pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()
            seen += real_rows(loader, batch, accelerator.process_index)
            if steps is not None and step + 1 == steps:
                break
    return seen


def save():
    world = PartialState().num_processes
    record = {}
    for variant in VARIANTS:
        accelerator, model, optimizer, loader = setup(variant)
        seen = train(accelerator, model, optimizer, loader, STEPS)
        accelerator.save_state(FOLDER / str(world) / variant)
        record[variant] = sorted(i for part in gather_object([seen]) for i in part)
        reset_state()
    if PartialState().is_main_process:
        (FOLDER / str(world) / "seen.json").write_text(json.dumps(record))
    fsdp_save(world)


def resume(saved_world):
    world, rank = PartialState().num_processes, PartialState().process_index
    before = json.loads((FOLDER / str(saved_world) / "seen.json").read_text())
    for variant in VARIANTS:
        accelerator, model, optimizer, loader = setup(variant)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            accelerator.load_state(FOLDER / str(saved_world) / variant)
        lines = [str(w.message) for w in caught if "random states" in str(w.message)]
        assert len(lines) == (1 if rank == 0 else 0), (
            f"{variant}: one line about random states on the main process only, got {lines}"
        )
        after = sorted(i for part in gather_object([train(accelerator, model, optimizer, loader)]) for i in part)
        both = Counter(before[variant]) + Counter(after)
        epoch = Counter(range(SAMPLES))
        assert both == epoch, (
            f"{variant} {saved_world}->{world}: repeated {sorted(both - epoch)}, missing {sorted(epoch - both)}"
        )
        told = lines[0] if lines else ""
        accelerator.print(
            f"{variant} {saved_world}->{world}: {len(before[variant])} + {len(after)} samples, each once; {told}"
        )
        reset_state()
    fsdp_resume(saved_world)


def fsdp_setup():
    accelerator = Accelerator(
        fsdp_plugin=FullyShardedDataParallelPlugin(
            state_dict_type="SHARDED_STATE_DICT", transformer_cls_names_to_wrap=["Block"]
        )
    )
    raw = make_model(0)
    optimizer = torch.optim.AdamW(raw.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(raw, optimizer)
    return accelerator, model, optimizer


def fsdp_train(accelerator, model, optimizer, steps):
    for tokens in steps:
        accelerator.backward(loss_fn(model, tokens))
        optimizer.step()
        optimizer.zero_grad()


def fsdp_save(world):
    accelerator, model, optimizer = fsdp_setup()
    fsdp_train(
        accelerator, model, optimizer, batches(STEPS, rank=accelerator.process_index, world=accelerator.num_processes)
    )
    accelerator.save_state(FOLDER / str(world) / "fsdp")
    weights = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        save_file(weights, FOLDER / str(world) / "fsdp_weights.safetensors")
    reset_state()


def fsdp_resume(saved_world):
    accelerator, model, optimizer = fsdp_setup()
    accelerator.load_state(FOLDER / str(saved_world) / "fsdp")
    weights = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        saved = load_file(FOLDER / str(saved_world) / "fsdp_weights.safetensors")
        assert weights.keys() == saved.keys() and all(torch.equal(weights[k], saved[k]) for k in saved), (
            "FSDP weights resharded"
        )
    for param in model.parameters():
        assert optimizer.state[param]["exp_avg"].shape == param.shape, (
            "FSDP optimizer state resharded to this run's shards"
        )
    fsdp_train(
        accelerator, model, optimizer, batches(2, rank=accelerator.process_index, world=accelerator.num_processes)
    )
    accelerator.print(f"fsdp {saved_world}->{accelerator.num_processes}: weights and optimizer state resharded")
    reset_state()


if MODE == "save":
    save()
else:
    resume(int(sys.argv[3]))
print(f"rank {PartialState().process_index}: resume_world_size {MODE} done", flush=True)
if torch.distributed.is_initialized():  # a gloo group torn down at interpreter exit aborted now and then
    torch.distributed.destroy_process_group()
