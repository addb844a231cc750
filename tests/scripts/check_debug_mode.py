"""Debug mode misuse scenarios; the test asserts on the output. Usage: check_debug_mode.py shapes|skip|reorder"""

import sys
import time

import torch

from hasten import PartialState
from hasten.utils import broadcast, gather

state = PartialState()
scenario = sys.argv[1]
if scenario == "shapes":
    tensor = torch.ones(1, 5) if state.process_index == 0 else torch.ones(1, 2, 5)
    broadcast(tensor)
elif scenario == "skip":
    gather(torch.ones(1))
    if state.process_index == 0:
        gather(torch.ones(1))  # rank 1 skips this collective and stays busy elsewhere
    else:
        time.sleep(60)
elif scenario == "reorder":
    gather(torch.ones(1))
    if state.process_index == 1:
        gather(torch.ones(1))
    gather(torch.ones(1))
print("unreachable: the misuse was not detected", flush=True)
