"""Rank 1 leaves the loop early and its script ends; rank 0 goes on gathering. Usage: fault_runtime_leave.py

Rank 0's next gather must fail naming rank 1 and the collective after which it exited.
"""

import torch

from hasten import PartialState
from hasten.utils import gather

state = PartialState()
steps = 1 if state.process_index == 1 else 4
for _ in range(steps):
    gather(torch.ones(2))
print(f"rank {state.process_index}: left the loop after {steps} step(s)", flush=True)
