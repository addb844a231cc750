"""A save that fails on one process only: both processes raise the same one-line CheckpointError, none hangs,
no partial folder is left and the previous checkpoint still loads.

Usage: torchrun --nproc_per_node 2 save_failure_two_processes.py DIR [--async]. Rank 1's random-state file
path is taken by a folder (created by a save hook on rank 1, which runs while the main process is still
late: the hook must get a folder that exists), so only the write of rank 1's states fails.
Prints ``rank R: failed cleanly: <message>``; then a save hook that raises on rank 1 (which comes first) fails
the save on both processes, with one message naming it: ``rank R: hook failure: <message>``. Last, the same hook on
rank 1 coming 1 s after the main process (which waits 0.2 s for it, then publishes) fails on rank 1 alone, saying
so: ``rank 1: late hook failure: <message>``.
"""

import os
import sys
import time
from pathlib import Path

import torch

from hasten import Accelerator
from hasten.checkpointing import participants, wait_for_pending_save
from hasten.errors import CheckpointError

folder, asynchronous = Path(sys.argv[1]), "--async" in sys.argv[2:]
acc = Accelerator()
model = torch.nn.Linear(16, 16)
model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
acc.save_state(folder / "good")
before = {k: v.clone() for k, v in model.state_dict().items()}


def block_rank_1(models, weights, output_dir):
    if acc.process_index == 1:
        os.mkdir(Path(output_dir) / "random_states_1.safetensors")


def failed_save(name: str) -> str:
    try:
        acc.save_state(folder / name, async_save=asynchronous)
        wait_for_pending_save()
    except CheckpointError as error:
        return str(error)
    sys.exit(f"rank {acc.process_index}: the save {name} did not fail")


handle = acc.register_save_state_pre_hook(block_rank_1)
if acc.process_index == 0:
    time.sleep(1.0)  # rank 1's hook runs before the main process created the temporary folder
message = failed_save("bad")
assert "\n" not in message and not (folder / "bad").exists() and not (folder / ".bad.partial").exists(), message
with torch.no_grad():
    for p in model.parameters():
        p.zero_()
acc.load_state(folder / "good")
assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
print(f"rank {acc.process_index}: failed cleanly: {message}", flush=True)
handle.remove()


def raise_on_rank_1(models, weights, output_dir):
    if acc.process_index == 1:
        raise ValueError("disk quota of the side files")


acc.register_save_state_pre_hook(raise_on_rank_1)
if acc.process_index == 0:
    time.sleep(1.0)  # rank 1's hook runs in the temporary folder: the main process waits for it
message = failed_save("hooked")
assert "\n" not in message and not (folder / "hooked").exists() and not (folder / ".hooked.partial").exists(), message
print(f"rank {acc.process_index}: hook failure: {message}", flush=True)
participants.JOIN_GRACE_S = 0.2  # how long the main process waits for processes that took part before
if acc.process_index == 1:
    time.sleep(1.0)  # the main process publishes without it
    print(f"rank 1: late hook failure: {failed_save('late')}", flush=True)
else:
    acc.save_state(folder / "late", async_save=asynchronous)
acc.end_training()
acc.wait_for_everyone()
assert (folder / "late" / "random_states_0.json").exists() and not (folder / "late" / "random_states_1.json").exists()
