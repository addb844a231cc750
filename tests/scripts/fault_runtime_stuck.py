"""Rank 1 gets stuck outside hasten's collectives while rank 0 waits in a gather. Usage: fault_runtime_stuck.py SCENARIO

SCENARIO is where rank 1 is stuck, before it ever enters a hasten collective: ``sleep`` (time.sleep),
``busy`` (a Python loop), ``gil`` (C code that holds the GIL), ``raw`` (a torch.distributed.all_reduce
that rank 0 never joins) or ``worker`` (waiting for a DataLoader worker that sleeps). The hang report of
rank 0 must show rank 1's stack (and its DataLoader worker's).
"""

import sys
import time

import torch
import torch.distributed as dist

from hasten import PartialState
from hasten.utils import gather


class SlowDataset(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, index):
        time.sleep(120)
        return torch.ones(1)


def spin_in_python():
    total = 0
    while True:
        total += 1


def hold_the_gil():
    return sum(range(10**15))  # runs in C without releasing the GIL


def wait_for_a_worker():
    loader = torch.utils.data.DataLoader(SlowDataset(), num_workers=1)
    return next(iter(loader))


state = PartialState()
scenario = sys.argv[1]
side_group = dist.new_group([0, 1]) if scenario == "raw" else None
if state.process_index == 0:
    gather(torch.ones(1))
elif scenario == "sleep":
    time.sleep(120)
elif scenario == "busy":
    spin_in_python()
elif scenario == "gil":
    hold_the_gil()
elif scenario == "raw":
    dist.all_reduce(torch.ones(1), group=side_group)
elif scenario == "worker":
    wait_for_a_worker()
print("unreachable: the hang was not ended", flush=True)
