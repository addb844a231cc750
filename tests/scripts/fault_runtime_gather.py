"""gather_for_metrics after the loop, on batches collected during it, across 2 processes.

For every dataset size x batch size x even_batches (and, for some, split_batches or dispatch_batches), both ways
users collect (a list of batches, and one concatenated tensor), every rank gets an answer (no rank left waiting)
holding every sample, both ways. After the loop the result is Accelerate's (rank by rank, padding samples
kept: gather_for_metrics trims only inside the loop's last batch), as tests/compat/test_differential_loop.py checks.
Usage: fault_runtime_gather.py
"""

import itertools

import torch
from torch.utils.data import DataLoader, TensorDataset

from hasten import Accelerator

accelerator = Accelerator()
assert accelerator.num_processes == 2
results = []
cases = [(n, b, even, "shard") for n, b, even in itertools.product((1, 7, 64, 101), (1, 4, 16), (True, False))]
cases += [
    (n, b, even, mode)
    for n, b, even, mode in itertools.product((1, 7, 101), (4, 16), (True, False), ("split", "dispatch"))
]
for n, batch_size, even, mode in cases:
    accelerator.even_batches = even
    accelerator.dataloader_config.split_batches = mode == "split"
    accelerator.dataloader_config.dispatch_batches = mode == "dispatch"
    data = torch.arange(n, dtype=torch.float32)[:, None] * torch.ones(1, 3)
    loader = accelerator.prepare(DataLoader(TensorDataset(data), batch_size=batch_size))
    collected = [batch for (batch,) in loader]
    # with even_batches=False a rank may have no batch at all (Accelerate's layout): its part is empty
    joined = accelerator.gather_for_metrics(torch.cat(collected) if collected else data[:0])
    as_list = accelerator.gather_for_metrics(collected)
    listed = (
        torch.cat(as_list)
        if isinstance(as_list, list) and all(isinstance(t, torch.Tensor) for t in as_list)
        else as_list
    )
    ok = (
        isinstance(joined, torch.Tensor)
        and isinstance(listed, torch.Tensor)
        and set(joined[:, 0].tolist()) == set(data[:, 0].tolist()) == set(listed[:, 0].tolist())
    )
    results.append(ok)
    if not ok:
        print(
            f"rank {accelerator.process_index}: n={n} batch_size={batch_size} even_batches={even} {mode}: "
            f"joined {joined if not isinstance(joined, torch.Tensor) else joined[:, 0].tolist()} "
            f"listed {listed if not isinstance(listed, torch.Tensor) else listed[:, 0].tolist()}",
            flush=True,
        )
print(
    f"rank {accelerator.process_index}: {sum(results)} of {len(results)} after-loop gathers hold every sample",
    flush=True,
)
