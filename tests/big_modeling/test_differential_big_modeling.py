"""The big-model utilities against Accelerate 1.15, case by generated case (tests/differential.py's harness).

Every scenario of differential_cases.py, differential_weights.py and differential_hooks.py runs on the reference copy
of Accelerate and on hasten, in subprocesses, over cases generated from seeds: random module trees (depth, widths,
buffers, tied weights, no-split classes, parameters on the root, empty modules) x memory budgets (ints and size
strings) x devices (GPU indices 0/1/2 planned without CUDA, ``"mps"``, ``"cpu"``, ``"disk"``) x options. The fast group
runs a sample of every scenario in one subprocess per side; the slow group runs each scenario on many more cases (a
share of them, ``helpers.cases``, unless ``--all-cases``: ``make test-all``).

``PYTHONHASHSEED`` is pinned for both sides: Accelerate orders tied-parameter groups and cleaned device maps by
iterating sets of strings, and hasten follows the same order, so results agree only under one hash seed.

A difference fails the test unless an entry of ``ALLOWED`` explains it; each entry names the scenarios, a test on
the case and both outcomes, what it is (a row of docs/migration.md's table "Deliberate differences in the big-model
utilities") and the reason. The whole slow group (``--all-cases``) also fails on an entry that no case needed any more.
"""

from __future__ import annotations

import helpers
import pytest
from big_modeling import differential_cases as planning
from big_modeling import differential_hooks as hooking
from big_modeling import differential_weights as weights
from big_modeling.differential_models import random_tree
from differential import differences, repro_line, run_side
from helpers import requires

MODULES = {"differential_cases": planning, "differential_weights": weights, "differential_hooks": hooking}

# scenario -> (generator, cases in the fast group, cases in the slow group); a generator takes (seed, count)
SCENARIOS = {
    "differential_cases:scenario_infer_auto_device_map": (planning.planner_cases, 25, 400),
    "differential_cases:scenario_get_balanced_memory": (planning.planner_cases, 10, 150),
    "differential_cases:scenario_balanced_then_map": (planning.planner_cases, 10, 150),
    "differential_cases:scenario_module_sizes": (planning.tree_cases, 8, 120),
    "differential_cases:scenario_get_max_memory": (planning.memory_cases, 10, 150),
    "differential_cases:scenario_max_memory_defaults": (planning.default_memory_cases, 1, 1),
    "differential_cases:scenario_device_map_checks": (planning.device_map_cases, 10, 150),
    "differential_cases:scenario_dtype_byte_size": (planning.dtype_cases, 4, 60),
    "differential_weights:scenario_load_checkpoint": (weights.load_cases, 12, 250),
    "differential_weights:scenario_set_module_tensor": (weights.tensor_cases, 8, 150),
    "differential_hooks:scenario_init_empty_weights": (hooking.init_cases, 6, 80),
    "differential_hooks:scenario_hooks": (hooking.hook_cases, 8, 150),
}
FAST_SEED, SLOW_SEED = 1, 2


def _model_buffers(case: dict) -> set[str]:
    return {name for name, _ in random_tree(case["tree"], case["knobs"]).named_buffers()}


def _disk_buffer(name: str, case: dict, buffers: set[str]) -> bool:
    from hasten.big_modeling.placement import device_for

    device_map = dict(case["device_map"] or {})
    return name in buffers and not case["offload_buffers"] and device_for(name, device_map) == "disk"


def _without_disk_buffers(case: dict, reference: dict, ours: dict) -> bool:
    """The outcomes agree once the buffers of modules mapped to disk are left out of both."""
    if case["device_map"] is None or "returned" not in reference or "returned" not in ours:
        return False
    buffers = _model_buffers(case)

    def strip(outcome: dict) -> dict:
        items = [list(item) for item in outcome["returned"]["items"]]
        tensors = items[0][1]
        kept = [entry for entry in tensors["items"] if not _disk_buffer(entry["items"][0], case, buffers)]
        items[0][1] = {**tensors, "items": kept}
        return {**outcome, "returned": {**outcome["returned"], "items": items}}

    return differences(strip(reference), strip(ours)) == []


def _ties_kept(case: dict, reference: dict, ours: dict) -> bool:
    """The outcomes agree but for tied weights that hasten kept tied and Accelerate untied."""
    if "returned" not in reference or "returned" not in ours:
        return False
    theirs, mine = (
        [item for item in outcome["returned"]["items"] if item[0] != "shared"] for outcome in (reference, ours)
    )
    shared = [
        next(item[1] for item in outcome["returned"]["items"] if item[0] == "shared") for outcome in (reference, ours)
    ]
    return theirs == mine and shared[0]["items"] == [] and shared[1]["items"] != []


def _raised(outcome: dict, name: str, text: str = "") -> bool:
    return "raised" in outcome and outcome["raised"][0] == name and text in outcome["message"]


ALLOWED = [
    {
        "scenario": "differential_hooks:scenario_init_empty_weights",
        "what": "weights tied inside `init_empty_weights` / `init_on_device`",
        "applies": _ties_kept,
        "reason": "Accelerate wraps every registered parameter in a new Parameter, which unties weights tied in the "
        "context; hasten keeps a parameter already on the target device as it is",
    },
    {
        "scenario": (
            "differential_cases:scenario_get_balanced_memory",
            "differential_cases:scenario_balanced_then_map",
        ),
        "what": '`get_balanced_memory` with a `"disk"` budget',
        "applies": lambda case, reference, ours: (
            case["balanced_disk"] and _raised(reference, "RuntimeError", "disk") and "returned" in ours
        ),
        "reason": "Accelerate passes 'disk' to torch.device and fails; hasten leaves the disk budget as it is",
    },
    {
        "scenario": "differential_weights:scenario_set_module_tensor",
        "what": '`set_module_tensor_to_device(dtype="float16")`, a dtype by name',
        "applies": lambda case, reference, ours: (
            isinstance(case["dtype"], str)
            and not case["dtype"].startswith("torch:")
            and _raised(reference, "RuntimeError", "Invalid device string")
            and "returned" in ours
        ),
        "reason": "Accelerate hands the name to Tensor.to, which reads it as a device and fails; hasten casts to it",
    },
    {
        "scenario": "differential_weights:scenario_load_checkpoint",
        "what": "`load_checkpoint_in_model` without a `device_map` into a model on the meta device",
        "applies": lambda case, reference, ours: (
            case["meta"] and case["device_map"] is None and _raised(reference, "ValueError", "process group")
        ),
        "reason": "Accelerate fails inside torch's set_model_state_dict (no process group); hasten loads on the CPU",
    },
    {
        "scenario": "differential_weights:scenario_load_checkpoint",
        "what": "`load_checkpoint_in_model(strict=True)`, keys missing from the checkpoint",
        "applies": lambda case, reference, ours: (
            case["strict"] and case["missing"] and "returned" in reference and _raised(ours, "StrictLoadError", "lacks")
        ),
        "reason": "Accelerate checks only unexpected keys and returns; hasten raises, as strict=True asks",
    },
    {
        "scenario": "differential_weights:scenario_load_checkpoint",
        "what": 'a `device_map` sending everything to `"disk"` with a safetensors checkpoint',
        "applies": lambda case, reference, ours: (
            case["format"] == "safetensors"
            and case["device_map"] is not None
            and {device for _, device in case["device_map"]} == {"disk"}
            and _raised(reference, "SafetensorError", "disk")
        ),
        "reason": "Accelerate asks safetensors to read on device 'disk' and fails; hasten offloads every tensor",
    },
    {
        "scenario": "differential_weights:scenario_load_checkpoint",
        "what": 'buffers of modules mapped to `"disk"`, `offload_buffers=False`',
        "applies": _without_disk_buffers,
        "reason": "Accelerate does not load them (they keep their initial values, which dispatch_model then uses); "
        "hasten loads the checkpoint's values on the CPU",
    },
]


@pytest.fixture(autouse=True)
def _pinned_hash_seed(monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "0")


def _allowance(scenario: str, case: dict, reference: dict, ours: dict):
    for index, entry in enumerate(ALLOWED):
        if scenario in _scenarios(entry) and entry["applies"](case, reference, ours):
            return index
    return None


def _scenarios(entry: dict) -> tuple[str, ...]:
    return entry["scenario"] if isinstance(entry["scenario"], tuple) else (entry["scenario"],)


def _scenario_path(scenario: str) -> str:
    return f"big_modeling.{scenario}"


def compare(scenario: str, cases: list[dict], used: set[int]) -> list[str]:
    """Run ``cases`` of ``scenario`` on both sides: one line per difference no allowance explains (the allowances
    used are added to ``used``)."""
    path = _scenario_path(scenario)
    ours, theirs = run_side("hasten", path, cases), run_side("accelerate", path, cases)
    return _judge([(scenario, case) for case in cases], theirs, ours, used)


def _judge(labelled: list[tuple[str, dict]], theirs: list, ours: list, used: set[int]) -> list[str]:
    failures = []
    for (scenario, case), reference, result in zip(labelled, theirs, ours):
        found = differences(reference, result)
        if not found:
            continue
        allowed = _allowance(scenario, case, reference, result)
        if allowed is not None:
            used.add(allowed)
            continue
        repro = repro_line(_scenario_path(scenario), case)
        failures.append(f"{scenario} seed {case['seed']}: {'; '.join(found[:3])}\n    repro: PYTHONHASHSEED=0 {repro}")
    return failures


def _report(failures: list[str], total: int) -> str:
    return f"{len(failures)} of {total} cases differ from Accelerate 1.15:\n" + "\n".join(failures[:15])


def _generate(scenario: str, seed: int, count: int) -> list[dict]:
    return SCENARIOS[scenario][0](seed, count)


@requires("reference")
def test_fast_sample_of_every_scenario():
    """A sample of every scenario, all in one subprocess per side (scenario_any dispatches on the case)."""
    labelled = [
        (scenario, case)
        for scenario, (_, fast, _) in SCENARIOS.items()
        for case in _generate(scenario, FAST_SEED, fast)
    ]
    wrapped = [{**case, "scenario": _scenario_path(scenario)} for scenario, case in labelled]
    ours = run_side("hasten", "big_modeling.differential_hooks:scenario_any", wrapped)
    theirs = run_side("accelerate", "big_modeling.differential_hooks:scenario_any", wrapped)
    failures = _judge(labelled, theirs, ours, set())
    assert len(labelled) >= 100
    assert not failures, _report(failures, len(labelled))


SLOW_USED: set[int] = set()
SLOW_COUNTS: dict[str, int] = {}


def _run_slow(scenario: str) -> list[str]:
    """The slow group's cases of ``scenario`` compared (counted in ``SLOW_COUNTS``): the failures."""
    generated = _generate(scenario, SLOW_SEED, helpers.cases(SCENARIOS[scenario][2]))
    failures = compare(scenario, generated, SLOW_USED)
    SLOW_COUNTS[scenario] = len(generated)
    return failures


@pytest.mark.slow
@pytest.mark.parametrize("scenario", list(SCENARIOS))
@requires("reference")
def test_slow_scenario(scenario):
    failures = _run_slow(scenario)
    assert not failures, _report(failures, SLOW_COUNTS[scenario])


@pytest.mark.slow
@requires("reference", "all cases")
def test_slow_group_size_and_allowances_still_needed():
    """Runs after the slow scenarios (same module, later in order: make test keeps a file on one worker), and runs
    those this process did not (a selection without them): 1,000+ cases, and no allowance unused."""
    for scenario in SCENARIOS:
        if scenario not in SLOW_COUNTS:
            failures = _run_slow(scenario)
            assert not failures, _report(failures, SLOW_COUNTS[scenario])
    assert sum(SLOW_COUNTS.values()) >= 1000
    stale = [entry["reason"] for index, entry in enumerate(ALLOWED) if index not in SLOW_USED]
    assert not stale, f"these allowances explained no case; remove them from ALLOWED and docs/migration.md: {stale}"


def test_allowances_are_documented():
    """Each allowance is a row of docs/migration.md's table, which has no other row."""
    from helpers import ROOT

    text = (ROOT / "docs" / "migration.md").read_text()
    section = text.split("## Deliberate differences in the big-model utilities", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith(("| case", "|---"))]
    assert sorted(row.split(" | ")[0].removeprefix("| ") for row in rows) == sorted(entry["what"] for entry in ALLOWED)
    assert all(set(_scenarios(entry)) <= set(SCENARIOS) and entry["reason"] for entry in ALLOWED)
