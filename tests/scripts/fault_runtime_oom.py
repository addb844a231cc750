"""find_executable_batch_size on 2 processes: rank 0 alone runs out of memory inside a DDP step.

At batch size 16, rank 0 raises an out-of-memory error at step 1, before its forward, while rank 1
is already in the step's gradient all-reduce. Both ranks must abandon the attempt, agree on 8 and
train the whole epoch at 8 with the same weights. With ``error``, rank 0 raises a ValueError there
instead: the job must end at once, not wait for rank 0's outcome. Usage: fault_runtime_oom.py [error]
"""

import sys
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

from hasten import Accelerator, find_executable_batch_size

accelerator = Accelerator()
rank = accelerator.process_index
torch.manual_seed(0)
X, Y = torch.randn(64, 8), torch.randn(64, 1)
tried = []


@find_executable_batch_size(starting_batch_size=16, reduce_batch_size_fn=lambda: tried[-1] // 2)
def train(batch_size):
    accelerator.free_memory()
    tried.append(batch_size)
    torch.manual_seed(1)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(X, Y), batch_size=batch_size)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    steps = 0
    for step, (x, y) in enumerate(loader):
        if batch_size == 16 and rank == 0 and step == 1 and "error" in sys.argv:
            raise ValueError("a bug in the training step (rank 0 only)")
        if batch_size == 16 and rank == 0 and step == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated, rank 0 only)")
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        steps += 1
    return batch_size, steps, model


def reference(batch_size):
    """The same training on one process: each global batch is the 2 ranks' batches of batch_size."""
    torch.manual_seed(1)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for start in range(0, 64, 2 * batch_size):
        x, y = X[start : start + 2 * batch_size], Y[start : start + 2 * batch_size]
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


start = time.monotonic()
batch_size, steps, model = train()
elapsed = time.monotonic() - start
weights = torch.cat([p.detach().flatten() for p in model.parameters()])
both = accelerator.gather(weights[None])
assert torch.equal(both[0], both[1]), f"weights differ across ranks: {both}"
gap = float((weights - reference(batch_size)).abs().max())
assert gap < 1e-6, f"weights differ from the one-process reference by {gap}"
print(
    f"rank {rank}: tried {tried}, ended at batch size {batch_size} after {steps} steps in {elapsed:.1f} s, "
    f"weights equal across ranks and to the reference (max gap {gap:.1e})",
    flush=True,
)
