"""``launch_command_parser()`` against Accelerate 1.15's, option by option (generated from the reference's own list
of options): the value each option holds when left off, and the value it parses from a given value, under both
spellings. Scripts and libraries that build on the parser (trl's CLI, notebook helpers, Accelerate's tests) read
these values as Accelerate gives them: ``args.multi_gpu is False``, ``args.num_processes == 4``."""

from __future__ import annotations

import pytest
from differential import run_side
from helpers import requires

from hasten.commands.launch_args import FLAGS

# What the test writes after an option of the reference's parser, by the name of the option's type.
_SAMPLES = {"int": "3", "float": "0.5", "str_to_bool": "false", "<lambda>": "true,false,true"}
# hasten's own options: Accelerate has no such flag.
_HASTEN_ONLY = {"as_accelerate", "requeue_on_preemption"}
# Options whose given value hasten parses differently on purpose, and why.
_PARSED_ON_PURPOSE = {
    "parallelism_config_sp_seq_length_is_variable": (
        "Accelerate converts the text with bool(), so 'false' reads as True; hasten reads true/false"
    ),
}


def _described() -> tuple[dict, dict]:
    scenario = "commands.differential_launch_cases:describe_options"
    (theirs,), (ours,) = run_side("accelerate", scenario, [{}]), run_side("hasten", scenario, [{}])
    assert "returned" in theirs and "returned" in ours, (theirs, ours)
    return _as_dict(theirs["returned"]), _as_dict(ours["returned"])


def _as_dict(described) -> dict:
    """tests/differential.py's ``describe`` of a dict of dicts, back to plain dicts."""
    if isinstance(described, dict) and described.get("dict"):
        return {_as_dict(key): _as_dict(value) for key, value in described["items"]}
    if isinstance(described, dict) and "seq" in described:
        return [_as_dict(item) for item in described["items"]]
    return described


def _sample(option: dict) -> list[str]:
    if option["switch"]:
        return []
    if option["choices"]:
        return [option["choices"][-1]]
    return [_SAMPLES.get(option["type"], "some-text")]


@pytest.mark.slow
@requires("reference")
def test_every_option_left_off_and_given_parses_as_in_accelerate():
    theirs, ours = _described()
    assert set(ours) - set(theirs) == _HASTEN_ONLY
    assert {flag.name for flag in FLAGS} - _HASTEN_ONLY <= set(theirs)
    shared = sorted(set(ours) & set(theirs))
    left_off = {name: (theirs[name]["left_off"], ours[name]["left_off"]) for name in shared}
    assert {name: pair for name, pair in left_off.items() if pair[0] != pair[1]} == {}
    cases = [
        {"dest": name, "argv": [spelling, *_sample(theirs[name]), "train.py"]}
        for name in shared
        if name not in _PARSED_ON_PURPOSE
        for spelling in theirs[name]["spellings"]
        if spelling.startswith("--")
    ]
    assert len(cases) > 2 * len(shared) - 20, "both spellings of (nearly) every option"
    scenario = "commands.differential_launch_cases:parse_one"
    expected, found = run_side("accelerate", scenario, cases), run_side("hasten", scenario, cases)
    wrong = [(case["argv"], e, f) for case, e, f in zip(cases, expected, found) if e != f]
    assert wrong == [], f"{len(wrong)} of {len(cases)} parses differ from Accelerate (argv, Accelerate, hasten)"
