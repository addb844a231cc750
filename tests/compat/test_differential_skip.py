"""``skip_first_batches`` against Accelerate 1.15, case by generated case (tests/compat/differential_skip_cases.py):
for prepared loaders (sharded, dispatched, split, over batch samplers and iterable datasets) and plain ones, on 1
and 2 processes, the type relationships, ``len()`` and attributes of what it returns, the batches of two iterations
and ``end_of_dataloader`` at each, the prepared loader's next iteration, and a ``save_state`` taken while the
skipped loader is iterated, loaded into a fresh run.

ALLOWED lists where hasten differs on purpose; each entry's case must still differ from Accelerate (an entry that
no longer differs fails: remove it). The list is mirrored in docs/migration.md ("Training loop and data loaders").
"""

from __future__ import annotations

import helpers
import pytest
from compat.differential_skip_cases import skip_cases
from compat.test_differential_loop import assert_agree
from differential import differences, run_side
from helpers import requires

SCENARIO = "compat.differential_skip_cases:skip_view"

_CASE = {
    "seed": 1,
    "kind": "prepared",
    "n": 12,
    "batch_size": 2,
    "dispatch": None,
    "split_batches": False,
    "shuffle": False,
    "drop_last": False,
    "skip": 2,
    "set_epoch": False,
    "save_at": None,
}

ALLOWED = [
    {
        "case": {**_CASE, "report": ["name"]},
        "nproc": 1,
        "reason": (
            "the class's name: hasten's view is a SkippedDataLoaderShard or SkippedDataLoaderDispatcher, subclasses "
            "of the prepared loader's class (isinstance answers as for Accelerate's new DataLoaderShard or "
            "DataLoaderDispatcher)"
        ),
    },
    {
        "case": {**_CASE, "report": ["total_batch_size"]},
        "nproc": 1,
        "reason": (
            "total_batch_size of a skipped map-style loader: Accelerate's raises AttributeError (its SkipBatchSampler "
            "has no batch_size); hasten's is the prepared loader's"
        ),
    },
    {
        "case": {**_CASE, "dispatch": True, "report": ["device"]},
        "nproc": 1,
        "reason": "device of a skipped dispatched loader: Accelerate's is None; hasten's is the device batches go to",
    },
    {
        "case": {**_CASE, "report": ["original_iteration"]},
        "nproc": 1,
        "reason": (
            "the skipped loader is a view of the prepared one (they share epoch and position, so save_state while the "
            "view is iterated records the view's position): once its epoch ends, the prepared loader is in the next "
            "epoch; Accelerate's is a copy, and the prepared loader stays in the epoch it was in (with "
            "use_seedable_sampler the loop's next epoch repeats the skipped epoch's order)"
        ),
    },
    {
        "case": {**_CASE, "skip": 6, "uncapped": True},
        "nproc": 1,
        "reason": (
            "an iteration that the skip leaves with no batch still ends the epoch (the next iteration is the next "
            "epoch), as for every prepared loader; Accelerate's loader stays in the same epoch after an iteration "
            "without batches"
        ),
    },
    {
        "case": {**_CASE, "dispatch": True},
        "nproc": 2,
        "reason": (
            "a dispatched map-style loader on several processes without split_batches: hasten skips n of the batches "
            "the loader hands out (global steps, what a loop counts); Accelerate skips n batches of the user's loader, "
            "of which the main process reads num_processes per step, so it skips n / num_processes steps and the "
            "resumed loop trains again on batches it already trained on"
        ),
    },
    {
        "case": {**_CASE, "n": 23, "dispatch": True, "split_batches": True, "skip": 6},
        "nproc": 2,
        "reason": (
            "a skipped dispatched loader whose last batch does not divide between the processes: hasten completes it "
            "with the epoch's first rows, as the uninterrupted epoch does; Accelerate with the first rows after the "
            "skip"
        ),
    },
]


@requires("reference")
def test_one_process_fast():
    """Every kind of input on one process, prepared with and without dispatching."""
    assert_agree(SCENARIO, skip_cases(seed=1, count=40))


@pytest.mark.slow
@requires("reference")
def test_one_process():
    assert_agree(SCENARIO, skip_cases(seed=2, count=helpers.cases(150)))


@pytest.mark.slow
@requires("reference")
def test_two_processes():
    assert_agree(SCENARIO, skip_cases(seed=3, count=helpers.cases(40), nproc=2), nproc=2)


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
@requires("reference")
def test_allowed_differences_still_differ(nproc):
    """Every allowed difference still differs (else its entry must go, and its line in docs/migration.md)."""
    entries = [entry for entry in ALLOWED if entry["nproc"] == nproc]
    cases = [entry["case"] for entry in entries]
    theirs, ours = run_side("accelerate", SCENARIO, cases, nproc), run_side("hasten", SCENARIO, cases, nproc)
    if nproc == 1:
        theirs, ours = [[r] for r in theirs], [[o] for o in ours]
    stale = [
        entry["reason"][:60]
        for entry, t, o in zip(entries, theirs, ours)
        if not any(differences(rank_t, rank_o) for rank_t, rank_o in zip(t, o))
    ]
    assert not stale, f"these allowed differences no longer differ; remove them and their docs line: {stale}"
