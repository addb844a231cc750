"""A scenario for tests/differential.py: how many collectives each operation makes, counted with torch's profiler.

``import accelerate`` is hasten or the reference copy of Accelerate 1.15; the same calls run on both sides (2
processes over gloo) and :func:`counts` returns, per call, the number of gloo operations it started.
"""

from __future__ import annotations


def counts(case: dict) -> str:
    """Gloo operations per call, as JSON: each listed operation called ``case["repeats"]`` times in a row, and
    ``gather_for_metrics`` on each batch of a prepared loader and after it."""
    import json

    import torch
    from torch.profiler import ProfilerActivity, profile

    from accelerate import Accelerator
    from accelerate.utils import broadcast, gather, pad_across_processes, reduce

    accelerator = Accelerator()
    rank = accelerator.process_index

    def count(call) -> int:
        with profile(activities=[ProfilerActivity.CPU]) as profiler:
            call()
        return sum(1 for event in profiler.events() if event.name.startswith("gloo:"))

    calls = {
        "gather": lambda: gather(torch.arange(8.0) + rank),
        "gather_pair": lambda: gather((torch.ones(4, 2) * rank, torch.arange(4) + rank)),
        "reduce_sum": lambda: reduce(torch.ones(3) * (rank + 1), "sum"),
        "broadcast": lambda: broadcast(torch.full((5,), float(rank))),
        "pad_across_processes": lambda: pad_across_processes(torch.ones(rank + 1, 2)),
        "wait_for_everyone": accelerator.wait_for_everyone,
        "accelerator_gather": lambda: accelerator.gather(torch.ones(2) * rank),
        "accelerator_reduce": lambda: accelerator.reduce(torch.tensor(1.5) * rank, "mean"),
    }
    result = {}
    for name, call in calls.items():
        result[name] = [count(call) for _ in range(case["repeats"])]
    dataset = torch.utils.data.TensorDataset(torch.arange(case["samples"], dtype=torch.float32)[:, None])
    loader = accelerator.prepare(torch.utils.data.DataLoader(dataset, batch_size=case["batch_size"]))
    per_batch, outputs = [], []
    for (batch,) in loader:
        outputs.append(batch)
        per_batch.append(count(lambda batch=batch: accelerator.gather_for_metrics(batch * 2)))
    result["gather_for_metrics"] = per_batch
    result["gather_for_metrics_after_loop"] = count(lambda: accelerator.gather_for_metrics(torch.cat(outputs)))
    return json.dumps(result)
