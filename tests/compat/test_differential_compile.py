"""torch.compile through ``prepare`` and the regional compilation helpers against Accelerate 1.15, case by generated
case (tests/differential.py).

The scenarios and generators are in tests/compat/differential_compile_cases.py: generated models (GPT-style with
lists of one class, of subclasses, of several classes, nested stage lists, tied heads, extras; Transformers Llama
and GPT-2 built from their config classes; models without repeated blocks) prepared with
``TorchDynamoPlugin(backend, use_regional_compilation)`` on one process, DDP, FSDP2 and DeepSpeed (ZeRO 2 and 3)
on 2 processes, and trained for 50 steps with bf16, gradient accumulation and clipping. Both sides must compile the
same modules and give dynamo the same unique graphs, graph breaks and recompilations; hasten must also recompile
nothing after the first optimizer update. The helpers (``is_repeated_blocks``, ``has_repeated_blocks``,
``compile_regions``, ``compile_regions_fsdp2``, ``compile_regions_deepspeed``, ``has_compiled_regions``) must answer
and compile alike.

``make test`` runs a few cases of each engine (``eager`` backend, 12 steps) and one small inductor case; ``make
test-all`` (``--all-cases``) runs every generated case, with ``aot_eager`` too, and checks that the differences in
``ALLOWED`` (mirrored in docs/migration.md, "torch.compile") still differ. Every test launches both sides in
subprocesses, so all are marked slow.
"""

from __future__ import annotations

import helpers
import pytest
from compat import differential_compile_cases as generated
from differential import differences, repro_line, run_side
from helpers import requires

pytestmark = requires("reference")  # every test compares with Accelerate 1.15
TRAIN = "compat.differential_compile_cases:train"
HELPERS = "compat.differential_compile_cases:helpers"

_GPT = {"kind": "gpt", "width": 8, "heads": 2, "seed": 3, "layers": ["block", "block"], "tied": True}
_FSDP2 = {
    "seed": 11,
    "engine": "fsdp2",
    "model": _GPT,
    "backend": "eager",
    "regional": True,
    "accumulation": 2,
    "clip": True,
    "batch": 2,
    "steps": 8,
}

ALLOWED = [
    {
        "scenario": "helpers",
        "nproc": 1,
        "cases": [
            {"seed": 1, "model": {**_GPT, "kind": "nested", "layers": ["block"], "groups": [2, 1]}},
            {"seed": 2, "model": {**_GPT, "kind": "nested", "layers": ["block", "feedforward"], "stages": [1]}},
            {"seed": 3, "model": {**_GPT, "kind": "nested", "layers": [], "stages": [2]}},
        ],
        "reason": (
            "a container that would be a region (a list of lists of blocks; a list of several classes, or an empty "
            "list, beside repeated blocks): Accelerate's compile_regions wraps it in torch.compile, which cannot be "
            "iterated (TypeError when the model runs; under FSDP2 and DeepSpeed it compiles the list in place, which "
            "compiles nothing); hasten compiles the list's items as regions"
        ),
    },
    {
        "scenario": "in_place_regions",
        "nproc": 1,
        "cases": [{"model": _GPT}],
        "reason": (
            "has_compiled_regions of a model compiled in place (nn.Module.compile: hasten's regional compilation on "
            "every engine, Accelerate's under FSDP2 and DeepSpeed) is True; Accelerate's only counts torch.compile "
            "wrappers"
        ),
    },
    {
        "scenario": "train",
        "nproc": 2,
        "cases": [{**_FSDP2, "regional": False}, {**_FSDP2, "model": {**_GPT, "layers": ["scaled", "block"]}}],
        "reason": (
            "the model's own forward compiled under FSDP2 with mixed precision (whole-model compilation, or a model "
            "without repeated blocks): hasten's forward runs under autocast (Accelerate's FSDP2 has no autocast "
            "wrapper, only FSDP's MixedPrecisionPolicy), and dynamo breaks that frame at the first sharded block, "
            "compiling the embeddings before and the fp32 conversion after it: 2 more graphs and 1 graph break. "
            "Accelerate's forward frame gives no graph at all there; the blocks are compiled alike"
        ),
    },
    {
        "scenario": "train",
        "nproc": 2,
        "cases": [{**_FSDP2, "activation_checkpointing": True}],
        "reason": (
            "FSDP2 with activation_checkpointing: hasten checkpoints blocks with torch's composable checkpoint, and "
            "the compiled blocks give one graph without a break; Accelerate's checkpoint_wrapper breaks the graph, "
            "so its checkpointed blocks are not compiled"
        ),
    },
]


def _outcomes(scenario: str, cases: list[dict], nproc: int) -> list[tuple[list[str], list]]:
    """For each case, the differences from Accelerate and hasten's own outcome (one per rank on several)."""
    theirs = run_side("accelerate", scenario, cases, nproc)
    ours = run_side("hasten", scenario, cases, nproc)
    if nproc == 1:
        return [(differences(r, o), [o]) for r, o in zip(theirs, ours)]
    return [
        ([f"rank {k}: {line}" for k, (r, o) in enumerate(zip(rs, os)) for line in differences(r, o)], os)
        for rs, os in zip(theirs, ours)
    ]


def _own_faults(outcome: dict) -> list[str]:
    """What hasten's training outcome must show whatever Accelerate's does: no recompilation after the first
    optimizer update, and finite losses."""
    if "returned" not in outcome:
        return [f"hasten raised {outcome['raised'][0]}: {outcome['message']}"]
    result = dict(outcome["returned"]["items"])
    faults = []
    if result["recompiles_after_first_update"]:
        faults.append(f"{result['recompiles_after_first_update']} recompilations after the first update")
    if not result["finite"]:
        faults.append("a loss is not finite")
    return faults


def assert_agree(scenario: str, cases: list[dict], nproc: int = 1) -> None:
    found = []
    for case, (lines, ours) in zip(cases, _outcomes(scenario, cases, nproc)):
        if scenario == TRAIN:
            lines = lines + [fault for outcome in ours for fault in _own_faults(outcome)]
        if lines:
            found.append((case, lines))
    shown = "\n".join(
        f"case {case}: {'; '.join(lines[:3])}\n    repro: {repro_line(scenario, case, nproc)}" for case, lines in found
    )
    assert not found, f"{len(found)} of {len(cases)} cases of {scenario} differ from Accelerate 1.15:\n{shown}"


# ------------------------------------------------------------------------------------------------- make test


# A few cases of each engine (seeds picked for compiled regions around repeated blocks: GPT-style, Llama, GPT-2), 12
# steps each (4 or more optimizer updates with any accumulation); the slow tests train 50 steps.


@pytest.mark.slow
def test_helpers_fast():
    """is/has_repeated_blocks, compile_regions and its twin, the in-place helpers, has_compiled_regions."""
    assert_agree(HELPERS, generated.helper_cases(seed=4, count=4))


@pytest.mark.slow
def test_one_process_fast():
    assert_agree(TRAIN, generated.training_cases(seed=8, count=2, engine="single", steps=12))


@pytest.mark.slow
def test_ddp_fast():
    assert_agree(TRAIN, generated.training_cases(seed=9, count=1, engine="ddp", steps=12), nproc=2)


@pytest.mark.slow
def test_fsdp2_fast():
    assert_agree(TRAIN, generated.training_cases(seed=6, count=1, engine="fsdp2", steps=12), nproc=2)


@pytest.mark.slow
@requires("deepspeed")
def test_deepspeed_fast():
    assert_agree(TRAIN, generated.training_cases(seed=8, count=1, engine="deepspeed", steps=12), nproc=2)


# --------------------------------------------------------------------------------------------- make test-all


@pytest.mark.slow
@requires("all cases")
def test_helpers():
    assert_agree(HELPERS, generated.helper_cases(seed=11, count=helpers.cases(80)))


@pytest.mark.slow
@requires("all cases")
def test_one_process():
    assert_agree(TRAIN, generated.training_cases(seed=12, count=helpers.cases(24), engine="single", backend="mixed"))


@pytest.mark.slow
@requires("all cases")
def test_ddp():
    assert_agree(
        TRAIN, generated.training_cases(seed=13, count=helpers.cases(8), engine="ddp", backend="mixed"), nproc=2
    )


@pytest.mark.slow
@requires("all cases")
def test_fsdp2():
    assert_agree(
        TRAIN, generated.training_cases(seed=14, count=helpers.cases(8), engine="fsdp2", backend="mixed"), nproc=2
    )


@pytest.mark.slow
@requires("deepspeed", "all cases")
def test_deepspeed():
    assert_agree(
        TRAIN, generated.training_cases(seed=15, count=helpers.cases(6), engine="deepspeed", backend="mixed"), nproc=2
    )


@pytest.mark.slow
def test_inductor_one_process():
    """The GPT of bench_gpu_lm's shape, small, compiled by inductor by region (and whole with ``--all-cases``:
    inductor compiles every case on both sides, 25-30 CPU-seconds each on 2 cores)."""
    case = {**_FSDP2, "engine": "single", "backend": "inductor", "steps": 12}
    model = {**_GPT, "layers": ["block"] * 4, "tied": True}
    cases = [{**case, "model": model}]
    if helpers.ALL_CASES:
        cases.append({**case, "model": model, "regional": False, "seed": 12})
    assert_agree(TRAIN, cases)


@pytest.mark.slow
@requires("all cases")
def test_allowed_differences_still_differ():
    """Every allowed difference still differs (else its entry must go, here and in docs/migration.md)."""
    stale = []
    for entry in ALLOWED:
        scenario = f"compat.differential_compile_cases:{entry['scenario']}"
        outcomes = _outcomes(scenario, entry["cases"], entry["nproc"])
        stale += [f"{entry['scenario']} {case}" for case, (lines, _) in zip(entry["cases"], outcomes) if not lines]
    assert not stale, f"these allowed differences no longer differ; remove them from ALLOWED and the docs: {stale}"
