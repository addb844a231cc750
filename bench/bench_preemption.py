"""Cost of the preemption check when no signal comes, per training step, against a raw PyTorch step.

hasten's per-step preemption work is a counter increment and a flag read at each real optimizer step
(``hasten.runtime.preemption.after_optimizer_step``) and a flag read after each batch a prepared dataloader
hands out (``hasten.runtime.preemption.save_due``). Two measurements, one process, 1 torch thread:

* ``micro``: the check alone (hook call + flag read), timed over ``--calls`` calls, in nanoseconds.
* ``steps``: a raw loop (MLP 256-512-256, batch 32, AdamW: forward, backward, step, zero_grad) and the
  same loop plus the check after every step, alternating (A B, then B A) for ``--rounds`` rounds of
  ``--steps`` steps. The ratio of medians is the cost as seen in training; the noise of a shared
  machine is larger than the check, so ``micro / raw step`` is the figure to hold against the 1 % budget.

Usage: python bench/bench_preemption.py [--rounds 9] [--steps 200] [--calls 1000000]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import describe, paired_ratio_range, ratio_of_medians, round_order  # noqa: E402

BATCH, WIDTH, HIDDEN = 32, 256, 512


def check_cost_ns(calls: int) -> float:
    """Nanoseconds per step of the no-signal check (hook + flag read), minus an empty loop's."""
    from hasten.runtime import preemption

    hook = preemption.after_optimizer_step
    start = time.perf_counter_ns()
    for _ in range(calls):
        hook()
        if preemption.save_due:
            raise AssertionError("no signal was sent")
    with_check = time.perf_counter_ns() - start
    start = time.perf_counter_ns()
    for _ in range(calls):
        pass
    empty = time.perf_counter_ns() - start
    return (with_check - empty) / calls


def make_loop():
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, WIDTH))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = [(torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)) for _ in range(16)]
    return model, optimizer, batches


def run_steps(steps: int, with_check: bool) -> float:
    """Seconds per step of ``steps`` raw steps, with or without the preemption check after each."""
    import torch

    from hasten.runtime import preemption

    model, optimizer, batches = make_loop()
    hook = preemption.after_optimizer_step
    start = time.perf_counter()
    for index in range(steps):
        x, y = batches[index % len(batches)]
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if with_check:
            hook()
            if preemption.save_due:
                raise AssertionError("no signal was sent")
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--calls", type=int, default=1_000_000)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    run_steps(20, True)  # warm-up
    samples: dict[str, list[float]] = {"raw": [], "raw + check": []}
    for index in range(args.rounds):
        for name in round_order(list(samples), index):
            samples[name].append(run_steps(args.steps, name != "raw"))
    micro = [check_cost_ns(args.calls) for _ in range(5)]
    for name, values in samples.items():
        print(describe(f"step {name}", values, unit="ms", scale=1e3))
    print(describe("check alone", micro, unit="ns", scale=1.0, digits=1))
    raw_step_ns = sorted(samples["raw"])[len(samples["raw"]) // 2] * 1e9
    median_check = sorted(micro)[len(micro) // 2]
    mid, low, high = paired_ratio_range(samples["raw + check"], samples["raw"])
    fastest = min(samples["raw + check"]) / min(samples["raw"])
    print(f"ratio raw+check / raw: medians {ratio_of_medians(samples['raw + check'], samples['raw']):.4f}, "
          f"per-round {mid:.4f} (min-max {low:.4f}-{high:.4f}), fastest rounds {fastest:.4f}")  # fmt: skip
    print(f"check / raw step: {median_check / raw_step_ns * 100:.4f} % (budget 1 %)")


if __name__ == "__main__":
    main()
