"""A collective that never completes: rank 1 sleeps where rank 0 enters a collective. Usage: fault_runtime_hang.py
[SCENARIO]

SCENARIO is the collective rank 0 waits in: ``gather`` (hasten's gather, the default), ``backward`` (DDP's gradient
all-reduce inside ``accelerator.backward``) or ``barrier`` (torch's own ``dist.barrier``). The hang watchdog must
end the job with its report, naming rank 1 as the process that did not arrive.
"""

import sys
import time

import torch
import torch.distributed as dist

from hasten import Accelerator
from hasten.utils import gather


def sleep_instead():
    time.sleep(120)


scenario = sys.argv[1] if len(sys.argv) > 1 else "gather"
accelerator = Accelerator()
model = accelerator.prepare(torch.nn.Linear(4, 1))
gather(torch.ones(1))
for _ in range(2):  # steps together (DDP rebuilds its buckets with a collective in the second forward)
    accelerator.backward(model(torch.ones(2, 4)).sum())
print(f"rank {accelerator.process_index}: waits from {time.time():.2f}", flush=True)
if accelerator.process_index == 1:
    sleep_instead()
elif scenario == "gather":
    gather(torch.ones(1))
elif scenario == "backward":
    accelerator.backward(model(torch.ones(2, 4)).sum())
elif scenario == "barrier":
    dist.barrier()
print("unreachable: the hang was not ended", flush=True)
