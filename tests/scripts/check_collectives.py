"""Collectives, process helpers, triggers and ordered logging across 2 real processes.

Run by tests/runtime/test_distributed.py; exits non-zero at the first failure.
"""

import logging
import sys
import time
from collections import namedtuple

import torch

from hasten import Accelerator
from hasten.logging import get_logger
from hasten.utils import (
    broadcast,
    broadcast_object_list,
    gather,
    gather_object,
    pad_across_processes,
    reduce,
    set_seed,
    synchronize_rng_states,
)

logging.basicConfig(stream=sys.stdout, format="%(message)s", level=logging.INFO)
accelerator = Accelerator()
RANK, N = accelerator.process_index, accelerator.num_processes
Pair = namedtuple("Pair", "a b")


def check_gather():
    data = {
        "x": torch.full((2, 3), float(RANK)),
        "items": [torch.tensor(RANK), Pair(torch.tensor([RANK]), torch.ones(1, 2) * RANK)],
    }
    out = gather(data)
    assert out["x"].shape == (4, 3) and out["x"][:2].eq(0).all() and out["x"][2:].eq(1).all(), out["x"]
    assert out["items"][0].tolist() == [0, 1], "0-dim tensors become 1-dim when gathered"
    assert isinstance(out["items"][1], Pair) and out["items"][1].a.tolist() == [0, 1]
    assert gather_object([RANK, RANK * 10]) == [0, 0, 1, 10]
    assert gather_object([{"r": RANK}]) == [{"r": 0}, {"r": 1}], "a list of one object gives one object per rank"
    assert gather_object({"r": RANK}) == ["r", "r"], (
        "as in Accelerate, each rank's object is iterated (a dict: its keys)"
    )
    assert accelerator.gather(torch.tensor([RANK + 1.0])).tolist() == [1.0, 2.0]
    # repeated calls carry their data inside the input check, in a buffer the next call reuses: every result must
    # be a tensor of its own (a reshaped view of the buffer changed under the caller's feet)
    results = [gather(torch.tensor([10.0 * step + RANK])) for step in range(3)]
    results += [gather(torch.tensor([[10.0 * step + RANK]]))[:, 0] for step in range(3, 5)]
    assert [r.tolist() for r in results] == [[10.0 * step, 10.0 * step + 1] for step in range(5)], results
    totals = [reduce(torch.tensor([step + RANK]), "sum") for step in range(3)]
    assert [t.tolist() for t in totals] == [[1], [3], [5]], totals


def check_reduce_broadcast_pad():
    t = torch.tensor([1.0 + RANK, 10.0])
    assert accelerator.reduce(t).tolist() == [3.0, 20.0], "Accelerator.reduce sums by default"
    assert reduce(t).tolist() == [1.5, 10.0], "utils.reduce averages by default"
    assert reduce(t, "max").tolist() == [2.0, 10.0]
    assert reduce(t, "sum", scale=0.5).tolist() == [1.5, 10.0]
    assert t.tolist() == [1.0 + RANK, 10.0], "reduce must not modify its input"
    b = broadcast({"v": torch.tensor([RANK * 7])}, from_process=1)
    assert b["v"].tolist() == [7]
    objs = broadcast_object_list([f"from {RANK}", {"k": RANK}])
    assert objs == ["from 0", {"k": 0}]
    padded = pad_across_processes(torch.ones(RANK + 1, 2), dim=0, pad_index=-1)
    assert padded.shape == (2, 2) and (RANK == 1 or padded[1].tolist() == [-1, -1])
    first = pad_across_processes(torch.ones(2, RANK + 2), dim=1, pad_first=True)
    assert first.shape == (2, 3) and (RANK == 1 or first[0].tolist() == [0, 1, 1])


def check_type_errors():
    batch = {"labels": [torch.ones(1), torch.ones(1), "oops"]}
    try:
        gather(batch)
    except TypeError as error:
        assert "data['labels'][2]" in str(error), str(error)
    else:
        raise AssertionError("gather of a string did not raise TypeError")


def check_process_helpers():
    with accelerator.split_between_processes(list(range(5))) as part:
        assert part == ([0, 1, 2] if RANK == 0 else [3, 4]), part
    with accelerator.split_between_processes(torch.arange(5), apply_padding=True) as part:
        assert part.tolist() == ([0, 1, 2] if RANK == 0 else [3, 4, 4]), part
    with accelerator.split_between_processes({"a": [1, 2], "b": ["x", "y"]}) as part:
        assert part == ({"a": [1], "b": ["x"]} if RANK == 0 else {"a": [2], "b": ["y"]})
    stamps = []
    with accelerator.main_process_first():
        stamps.append(time.time())
    order = gather_object(stamps)
    assert order[0] <= order[1], "main process must run the block first"
    ran = accelerator.on_process(lambda: RANK, process_index=1)()
    assert ran == (1 if RANK == 1 else None)
    assert accelerator.on_main_process(lambda: "main")() == ("main" if RANK == 0 else None)
    assert accelerator.on_last_process(lambda: "last")() == ("last" if RANK == 1 else None)


def check_rng():
    set_seed(3, device_specific=True)
    draws = gather_object([torch.rand(1).item()])
    assert draws[0] != draws[1], "device_specific seeds must differ per rank"
    synchronize_rng_states(["torch"])
    draws = gather_object([torch.rand(1).item()])
    assert draws[0] == draws[1], "synchronised torch RNG must draw the same on every rank"


def check_trigger():
    stop_steps = []
    for step in range(10):
        if RANK == 1 and step == 4:
            accelerator.set_trigger()
        if accelerator.check_trigger():
            stop_steps.append(step)
            break
    assert gather_object(stop_steps) == [4, 4], f"both ranks must stop at step 4, got {gather_object(stop_steps)}"
    assert not accelerator.check_trigger(), "the trigger resets after it is read"


def check_ordered_logging():
    logger = get_logger("ordered", log_level="INFO")
    for i in range(3):
        logger.info(f"ORDERED round {i} rank {RANK}", main_process_only=False, in_order=True)
    logger.info("MAIN ONLY")


for check in (
    check_gather,
    check_reduce_broadcast_pad,
    check_type_errors,
    check_process_helpers,
    check_rng,
    check_trigger,
    check_ordered_logging,
):
    check()
    accelerator.wait_for_everyone()
accelerator.print("collective checks passed")
