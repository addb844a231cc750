"""The training loop and the data loaders against Accelerate 1.15, case by generated case (tests/differential.py).

The scenarios and case generators (tests/compat/differential_loop_cases.py, differential_training_cases.py)
cover batch samplers with fixed and varying batch sizes sharded for 2 to 4 processes, iterable shards,
``prepare_data_loader`` for simulated ranks, training loops (shuffling of every kind, dropout, accumulation,
split/even batches, iterable datasets sharded or dispatched, several epochs) on 1 and 2 processes,
``save_state``/``load_state`` resumes, ``gather_for_metrics`` with the loader's rows and others,
``GradientState`` and its plugin, the enums. Losses, weights, batches and the global
generators' next values must be equal bit for bit.

The generators leave out the situations listed in ALLOWED, where hasten differs on purpose; each entry runs its
own case(s) and must still differ from Accelerate (an entry that no longer differs fails: remove it). Entries
without a case describe what cannot run on the reference at all (it hangs or aborts the process). The list is
mirrored in docs/migration.md ("Training loop and data loaders").
"""

from __future__ import annotations

import helpers
import pytest
from compat import differential_loop_cases as loop
from compat import differential_training_cases as training
from differential import differences, repro_line, run_side
from helpers import requires

MIXED = "compat.differential_loop_cases:mixed"
SCENARIOS = "compat.differential_training_cases:"

_RESUME = {
    "n": 12,
    "batch_size": 2,
    "split_batches": False,
    "epochs": 2,
    "save_after": 2,
    "accumulation": 1,
    "optimizer": "sgd",
    "scheduler": False,
}
_PREPARE = {
    "seed": 5,
    "n": 10,
    "split_batches": False,
    "batch_size": 2,
    "even_batches": True,
    "seedable": False,
    "data_seed": None,
    "drop_last": False,
    "rng_types": None,
}
_EMPTY_DISPATCH = {
    "seed": 1,
    "n": 3,
    "batch_size": 4,
    "split_batches": False,
    "even_batches": True,
    "dataset": "iterable",
    "drop_last": True,
    "dispatch": True,
    "output": "batch",
    "after_loop": False,
}

ALLOWED = [
    {
        "scenario": "skip_batch_sampler",
        "cases": [{"seed": 3, "skip": 40}],
        "reason": (
            "skipping more batches than there are: Accelerate's SkipBatchSampler has a negative length, so len() "
            "raises ValueError; hasten's is 0 (skip_first_batches then yields nothing in both)"
        ),
    },
    {
        "scenario": "gather_metrics",
        "cases": [_EMPTY_DISPATCH],
        "reason": (
            "a dispatched loader with no batch at all (drop_last, fewer samples than a batch): Accelerate raises "
            "ValueError on one process and TypeError on several when iterated; hasten yields no batch, as a plain "
            "DataLoader does"
        ),
    },
    {
        "scenario": "prepare_loader",
        "cases": [{**_PREPARE, "world": 1, "batch_size": 3, "sampler": "sampler_is_batch_sampler"}],
        "reason": (
            "a BatchSampler given as `sampler` (batch_size=None) on one process: Accelerate passes batch_size twice "
            "and raises TypeError; hasten keeps the batch sampler in place (as Accelerate does on several processes)"
        ),
    },
    {
        "scenario": "prepare_loader",
        "cases": [{**_PREPARE, "world": 2, "sampler": "distributed_sampler"}],
        "reason": (
            "a loader that already has a DistributedSampler, on several processes: Accelerate shards it a second "
            "time (each process sees 1/N of its 1/N); hasten keeps it as it is and warns"
        ),
    },
    {
        "scenario": "prepare_loader",
        "cases": [{**_PREPARE, "world": 2, "sampler": "shuffle", "report_sampler": True}],
        "reason": (
            "get_sampler() of a loader prepared for several processes: Accelerate's BatchSamplerShard has no "
            "`sampler`, so get_sampler returns None (unless use_seedable_sampler); hasten's gives the wrapped batch "
            "sampler's sampler"
        ),
    },
    {
        "scenario": "iterable_dataset_shard",
        "cases": [{"seed": 2, "world": 2, "split": True, "batch_size": 1, "n": 6}],
        "reason": (
            "IterableDatasetShard with split_batches and a batch size of 1 gives every process nothing in "
            "Accelerate, silently; hasten refuses it with a ConfigError (a ValueError) saying to use a multiple of "
            "the number of processes"
        ),
    },
    {
        "scenario": "enum_member",
        "cases": [],
        "reason": (
            "LoggerType has one more member, JSONL (hasten's dependency-free tracker); the scenario leaves it out of "
            "the comparison (differential_loop_cases.HASTEN_EXTRA_MEMBERS)"
        ),
    },
    {
        "scenario": "resume",
        "cases": [{**_RESUME, "seed": 11, "kind": "shuffle", "dropout": True}],
        "reason": (
            "resuming in the middle of an epoch: hasten replays the generators' states recorded at the epoch's start "
            "(the checkpoint holds them), so the resumed run is the uninterrupted one bit for bit; Accelerate draws "
            "the epoch's seeds again from the restored global generator, so with dropout, or with a plain shuffling "
            "sampler on one process, its resumed run differs from its own uninterrupted run (both uninterrupted "
            "runs are equal)"
        ),
    },
    {
        "scenario": "resume",
        "cases": [{**_RESUME, "seed": 12, "kind": "seedable", "dropout": False}],
        "reason": (
            "load_state gives prepared loaders back their epoch (Accelerate's stay at epoch 0 in a new process), so "
            "with use_seedable_sampler the epochs after a resumed one keep the uninterrupted run's orders; "
            "Accelerate repeats epoch 0's"
        ),
    },
    {
        "scenario": "training_loop",
        "cases": [{**training.training_cases(seed=3, count=1)[0], "accumulation": 2, "clip": "norm_every_step"}],
        "reason": (
            "clip_grad_norm_ called on an accumulation step (gradients not complete yet, the clipping is applied to a "
            "part of them): hasten warns once, saying to guard it with `if accelerator.sync_gradients:`; Accelerate "
            "is silent. The numbers are the same"
        ),
    },
    {
        "scenario": "training_loop (not run on one process)",
        "cases": [],
        "reason": (
            "every rank shuffles alike: the shuffling generator is synchronised at each epoch start even when "
            "rng_types leaves out 'generator', and under use_seedable_sampler without data_seed rank 0's seed is "
            "shared; Accelerate then shuffles with each rank's own state when the ranks were seeded differently "
            "(set_seed(device_specific=True)), so the shards overlap"
        ),
    },
    {
        "scenario": "loader attributes (not compared)",
        "cases": [],
        "reason": (
            "two attributes of a prepared loader: on one process its batch_sampler wraps the user's (a "
            "PassThroughBatchSampler, whose batch_sampler is the user's: it lets a resumed epoch skip batches without "
            "loading them; Accelerate hands back the user's own); total_batch_size of a loader over a sharded "
            "iterable dataset is the global batch (Accelerate reports one process's)"
        ),
    },
    {
        "scenario": "join_uneven_inputs (not run)",
        "cases": [],
        "reason": (
            "join_uneven_inputs on CPU processes (MULTI_CPU): hasten joins with torch's Join as under DDP on GPUs; "
            "Accelerate only warns there, so a loop whose processes run different numbers of steps "
            "(even_batches=False) hangs"
        ),
    },
    {
        "scenario": "gather_metrics (not run)",
        "cases": [],
        "reason": (
            "gather_for_metrics when the processes hold different numbers of rows (even_batches=False with an "
            "uneven last round, or after the loop): Accelerate's gather aborts the process (gloo: size mismatch); "
            "hasten gathers each process's rows at their sizes (the dataset exactly, in order, after the loop)"
        ),
    },
]


def _outcomes(scenario: str, cases: list[dict], nproc: int) -> list[list[str]]:
    """For each case, the differences between Accelerate and hasten (empty when they agree)."""
    theirs = run_side("accelerate", scenario, cases, nproc)
    ours = run_side("hasten", scenario, cases, nproc)
    if nproc == 1:
        return [differences(r, o) for r, o in zip(theirs, ours)]
    return [
        [f"rank {k}: {line}" for k, (r, o) in enumerate(zip(rs, os)) for line in differences(r, o)]
        for rs, os in zip(theirs, ours)
    ]


def assert_agree(scenario: str, cases: list[dict], nproc: int = 1) -> None:
    found = [(case, lines) for case, lines in zip(cases, _outcomes(scenario, cases, nproc)) if lines]
    shown = "\n".join(
        f"case {case}: {'; '.join(lines[:3])}\n    repro: {repro_line(scenario, case, nproc)}"
        for case, lines in found[:15]
    )
    assert not found, f"{len(found)} of {len(cases)} cases of {scenario} differ from Accelerate 1.15:\n{shown}"


# --------------------------------------------------------------------------------------------------------- fast


@requires("reference")
def test_one_process_scenarios_fast():
    """Batch samplers on 2-4 processes, iterable shards, skipping, prepare for simulated ranks, enums, gradient
    state."""
    assert_agree(MIXED, loop.one_process_cases(seed=1, count=100))


# --------------------------------------------------------------------------------------------------------- slow


@pytest.mark.slow
@requires("reference")
def test_one_process_scenarios():
    assert_agree(MIXED, loop.one_process_cases(seed=2, count=helpers.cases(400)))


@pytest.mark.slow
@requires("reference")
def test_training_loops_one_process():
    assert_agree(SCENARIOS + "training_loop", training.training_cases(seed=3, count=helpers.cases(100)))


@pytest.mark.slow
@requires("reference")
def test_training_loops_two_processes():
    assert_agree(
        SCENARIOS + "training_loop", training.training_cases(seed=4, count=helpers.cases(40), nproc=2), nproc=2
    )


@pytest.mark.slow
@requires("reference")
def test_resume_one_process():
    assert_agree(SCENARIOS + "resume", training.resume_cases(seed=5, count=helpers.cases(20)))


@pytest.mark.slow
@requires("reference")
def test_resume_two_processes():
    assert_agree(SCENARIOS + "resume", training.resume_cases(seed=6, count=helpers.cases(12), nproc=2), nproc=2)


@pytest.mark.slow
@requires("reference")
def test_gather_for_metrics_one_process():
    assert_agree(SCENARIOS + "gather_metrics", training.gather_cases(seed=7, count=helpers.cases(120)))


@pytest.mark.slow
@requires("reference")
def test_gather_for_metrics_two_processes():
    assert_agree(SCENARIOS + "gather_metrics", training.gather_cases(seed=8, count=helpers.cases(50), nproc=2), nproc=2)


@pytest.mark.slow
@requires("reference")
def test_allowed_differences_still_differ():
    """Every allowed difference that can run on the reference still differs (else its entry must go)."""
    runnable = [(entry, case) for entry in ALLOWED for case in entry["cases"]]
    outcomes = _outcomes(MIXED, [{"scenario": entry["scenario"], "case": case} for entry, case in runnable], 1)
    stale = [f"{entry['scenario']} {case}" for (entry, case), lines in zip(runnable, outcomes) if not lines]
    assert not stale, (
        f"these allowed differences no longer differ; remove them from ALLOWED and docs/migration.md: {stale}"
    )
