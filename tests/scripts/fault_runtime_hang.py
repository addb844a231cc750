"""A collective that never completes, outside debug mode. Usage: fault_runtime_hang.py

Rank 1 skips the second gather and sleeps; the hang watchdog must end the job with its report.
"""

import time

import torch

from hasten import PartialState
from hasten.utils import gather

state = PartialState()
gather(torch.ones(1))
if state.process_index == 0:
    gather(torch.ones(1))
else:
    time.sleep(120)
print("unreachable: the hang was not ended", flush=True)
