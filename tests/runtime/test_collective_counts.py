"""hasten's collectives check their inputs across processes without costing a collective more than Accelerate's: a
call repeated with the same sizes is one all-gather carrying both the check and the data (2 processes, gloo; the
number of gloo operations of each call counted with torch's profiler on hasten and on Accelerate 1.15)."""

import json

import pytest
from differential import run_side
from helpers import requires

SCENARIO = "runtime.collective_counts:counts"


@pytest.mark.slow
@requires("reference")
def test_repeated_collectives_cost_no_more_than_accelerates():
    case = {"repeats": 3, "samples": 21, "batch_size": 4}
    ours = run_side("hasten", SCENARIO, [case], nproc=2)[0]
    theirs = run_side("accelerate", SCENARIO, [case], nproc=2)[0]
    for rank, (mine, reference) in enumerate(zip(ours, theirs)):
        mine, reference = json.loads(mine["returned"]), json.loads(reference["returned"])
        shown = f"rank {rank}: hasten {mine}, Accelerate {reference}"
        # a new size sends the check alone first: the first call of each operation, and after the loop
        assert mine["gather_for_metrics_after_loop"] <= reference["gather_for_metrics_after_loop"] + 1, shown
        for name, counted in mine.items():
            if name != "gather_for_metrics_after_loop":
                later = counted if name == "gather_for_metrics" else counted[1:]
                assert all(c <= r for c, r in zip(later, reference[name][-len(later) :])), (name, shown)
        assert mine["gather"][1:] == [1, 1], shown
        assert mine["gather_for_metrics"] == [1] * len(mine["gather_for_metrics"]), shown
