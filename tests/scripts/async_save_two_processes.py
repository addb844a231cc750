"""Asynchronous save on 2 processes: training goes on while the files are written; the checkpoint holds
the state of the moment ``save_state`` was called, with every rank's files (rank 1's random states in the
manifest, or added after the publish when rank 1 came after the main process wrote its files) and one manifest.

Usage: torchrun --nproc_per_node 2 async_save_two_processes.py DIR. Prints ``rank R: async save ok``.
"""

import sys
from pathlib import Path

import torch

from hasten import Accelerator
from hasten.checkpointing import CheckpointReader, wait_for_pending_save
from hasten.utils import ProjectConfiguration, set_seed

folder = Path(sys.argv[1])
acc = Accelerator(
    project_config=ProjectConfiguration(project_dir=str(folder), automatic_checkpoint_naming=True, async_save=True)
)
set_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))


def step():
    x = torch.randn(8, 64)
    acc.backward(model(x).square().mean())
    opt.step()
    opt.zero_grad()


for _ in range(3):
    step()
saved = {k: v.clone() for k, v in acc.unwrap_model(model).state_dict().items()}
saved_rng = torch.get_rng_state().clone()
path = acc.save_state()
for _ in range(3):
    step()  # the weights change while (or after) the background thread writes
assert wait_for_pending_save() == Path(path)
acc.wait_for_everyone()  # a process that came after the main process wrote its files adds its random states
files = CheckpointReader(path).files  # the manifest's, and random states added after the publish
assert {"random_states_0.json", "random_states_1.json", "model.safetensors"} <= set(files), sorted(files)
after = torch.get_rng_state().clone()
acc.load_state()
for key, value in acc.unwrap_model(model).state_dict().items():
    assert torch.equal(value, saved[key]), key
assert torch.equal(torch.get_rng_state(), saved_rng) and not torch.equal(after, saved_rng)
acc.end_training()
print(f"rank {acc.process_index}: async save ok", flush=True)
