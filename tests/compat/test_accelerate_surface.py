"""hasten's public surface against Accelerate 1.15's, name by name and signature by signature.

``make test`` installs a reference copy of ``accelerate==1.15.0`` into ``.reference/`` (never into the venv). One
subprocess, the only place that sees it, dumps every public module, name and signature of Accelerate
(tests/scripts/dump_api_surface.py); another dumps what hasten has at the same paths; this test compares them.
The differences we chose are listed below, each with its reason (mirrored in docs/migration.md, "Deliberate
differences from Accelerate's surface"); anything else fails, and so does an entry that is no longer needed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from helpers import ROOT, SCRIPTS, clean_env, requires

REFERENCE = ROOT / ".reference" / "accelerate-1.15.0"
DUMP = SCRIPTS / "dump_api_surface.py"

# Reference modules that cannot be imported without an optional package, and why hasten need not mirror them.
REFERENCE_NEEDS_OPTIONAL = {
    "accelerate.utils.rich": (
        "imports `rich` and installs rich tracebacks; hasten has no such side effect (is_rich_available exists)"
    ),
}

# The deliberate differences, by (module, name) or, for a method, (module, "Class.method"); "*" matches any module
# and "Class.*" any method of the class. "missing": hasten has no such name; "extra_params": hasten's signature is
# Accelerate's plus optional parameters at the end; "differs": the signature or value differs as the reason says.
ALLOWED = [
    {
        "names": [("*", "logger")],
        "difference": "missing",
        "reason": (
            "module-level `logger` objects are not API: hasten's modules log through their own `hasten.*` loggers"
        ),
    },
    {
        "names": [("accelerate.commands.config", "default_config_file"), ("accelerate.utils", "write_basic_config")],
        "difference": "differs",
        "reason": (
            "hasten's config folder is ~/.cache/huggingface/hasten (or $HASTEN_HOME), so the default config path "
            "differs"
        ),
    },
    {
        "names": [
            ("accelerate", "notebook_launcher"),
            ("accelerate.launchers", "notebook_launcher"),
            ("accelerate.optimizer", "AcceleratedOptimizer"),
            ("accelerate.scheduler", "AcceleratedScheduler"),
            ("accelerate.utils", "DeepSpeedSchedulerWrapper"),
            ("accelerate.utils.deepspeed", "DeepSpeedSchedulerWrapper"),
            ("accelerate.tracking", "MLflowTracker"),
            ("accelerate", "Accelerator.save_state"),
            ("accelerate.accelerator", "Accelerator.save_state"),
            ("accelerate", "Accelerator"),
            ("accelerate.accelerator", "Accelerator"),
            ("accelerate.utils", "ProjectConfiguration"),
            ("accelerate.utils.dataclasses", "ProjectConfiguration"),
            ("accelerate", "AutocastKwargs"),
            ("accelerate.utils", "AutocastKwargs"),
            ("accelerate.utils.dataclasses", "AutocastKwargs"),
        ],
        "difference": "extra_params",
        "reason": (
            "hasten additions after Accelerate's parameters (start_method, strategy, tracking_uri, async_save, "
            "convert_outputs_to_fp32; the wrappers' keyword-only state and gradient_state, which the Accelerator "
            "hands in instead of their looking the process's up); every call written for Accelerate works unchanged"
        ),
    },
    {
        "names": [
            ("accelerate.data_loader", "DataLoaderShard"),
            ("accelerate.data_loader", "DataLoaderDispatcher"),
            ("accelerate.data_loader", "SkipDataLoader"),
            ("accelerate.data_loader", "SeedableRandomSampler"),
        ],
        "difference": "differs",
        "reason": (
            "hasten's loader classes are built by prepare_data_loader / Accelerator.prepare / skip_first_batches with "
            "their own internal parameters; build loaders through those functions"
        ),
    },
    {
        "names": [
            ("accelerate.data_loader", f"{cls}.{method}")
            for cls, methods in {
                "DataLoaderShard": ("adjust_state_dict_for_prefetch", "get_sampler", "set_sampler", "reset"),
                "DataLoaderDispatcher": ("adjust_state_dict_for_prefetch", "get_sampler", "set_sampler", "reset"),
                "SkipDataLoader": (
                    "adjust_state_dict_for_prefetch",
                    "begin",
                    "end",
                    "reset",
                    "state_dict",
                    "load_state_dict",
                ),
                "DataLoaderStateMixin": ("reset",),
            }.items()
            for method in methods
        ],
        "difference": "missing",
        "reason": (
            "hasten's loaders keep their position and sampler themselves (state_dict/load_state_dict on "
            "DataLoaderShard "
            "and DataLoaderDispatcher, set_epoch); Accelerate's internal hooks for StatefulDataLoader prefetch and "
            "sampler "
            "swapping have no counterpart"
        ),
    },
    {
        "names": [
            ("accelerate.data_loader", "DataLoaderShard.load_state_dict"),
            ("accelerate.data_loader", "DataLoaderDispatcher.load_state_dict"),
        ],
        "difference": "differs",
        "reason": "the parameter is named `state`, not `state_dict` (positional use is the same)",
    },
    {
        "names": [("*", "Accelerator.init_trackers"), ("*", "Accelerator.log")],
        "difference": "differs",
        "reason": (
            "Accelerate's main-process decorator hides these signatures (it reports *args, **kwargs); hasten's are "
            "the documented ones: init_trackers(project_name, config=None, init_kwargs=None), log(values, step=None, "
            "log_kwargs=None)"
        ),
    },
    {
        "names": [
            ("*", f"{cls}.*")
            for cls in (
                "MegatronLMPlugin",
                "MegatronEngine",
                "MegatronLMDummyDataLoader",
                "MegatronLMOptimizerWrapper",
                "MegatronLMSchedulerWrapper",
                "AbstractTrainStep",
                "BertTrainStep",
                "GPTTrainStep",
                "T5TrainStep",
                "DeepSpeedEngineWrapper",
                "DeepSpeedOptimizerWrapper",
            )
        ],
        "difference": "missing",
        "reason": (
            "classes of engines hasten does not drive (Megatron-LM) and internals of Accelerate's DeepSpeed wiring: "
            "constructing one raises NotSupportedError, so they have no methods"
        ),
    },
    {
        "names": [("accelerate.data_loader", "DataLoaderAdapter")],
        "difference": "missing",
        "reason": (
            "Accelerate's base wrapper switching between DataLoader and torchdata's StatefulDataLoader; hasten's "
            "loaders subclass DataLoader directly"
        ),
    },
    {
        "names": [("accelerate.utils", "find_tied_parameters"), ("accelerate.utils.modeling", "find_tied_parameters")],
        "difference": "differs",
        "reason": (
            "no **kwargs: Accelerate accepts and ignores unknown keywords, hasten refuses them instead of ignoring them"
        ),
    },
    {
        "names": [
            ("accelerate.test_utils", "DEFAULT_LAUNCH_COMMAND"),
            ("accelerate.test_utils.testing", "DEFAULT_LAUNCH_COMMAND"),
        ],
        "difference": "differs",
        "reason": (
            "test launch commands run `python -m hasten.commands.main launch --key value` with this interpreter, so "
            "no `accelerate` (or `hasten`) executable is needed on PATH"
        ),
    },
    {
        "names": [("accelerate.utils.imports", "USE_TORCH_XLA")],
        "difference": "differs",
        "reason": "hasten never uses torch_xla (TPUs are not supported), so the switch is False",
    },
]


def _dump(package: str, pythonpath: str, stdin: str | None = None) -> dict:
    env = clean_env(PYTHONPATH=pythonpath)
    proc = subprocess.run(
        [sys.executable, str(DUMP), package],
        input=stdin,
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=180,
    )
    assert proc.returncode == 0, f"dumping {package}'s surface failed:\n{proc.stderr[-6000:]}"
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def surfaces() -> tuple[dict, dict]:
    reference_text = json.dumps(_dump("accelerate", str(REFERENCE)))
    src = str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")
    return json.loads(reference_text), _dump("hasten", src, stdin=reference_text)


def _allowed(module: str, name: str) -> dict | None:
    candidates = {(module, name), ("*", name)}
    if "." in name:
        candidates |= {("*", name.split(".")[0] + ".*")}
    for entry in ALLOWED:
        if candidates & set(entry["names"]):
            return entry
    return None


def _extra_params_only(reference: dict, ours: dict) -> bool:
    if reference.get("kind") != ours.get("kind") or reference.get("signature") is None or ours.get("signature") is None:
        return False
    theirs = [p for p in reference["signature"] if p[1] != "VAR_KEYWORD"]
    mine = [p for p in ours["signature"] if p[1] != "VAR_KEYWORD"]
    same_kwargs = any(p[1] == "VAR_KEYWORD" for p in reference["signature"]) == any(
        p[1] == "VAR_KEYWORD" for p in ours["signature"]
    )
    return same_kwargs and mine[: len(theirs)] == theirs and all(p[2] is not None for p in mine[len(theirs) :])


def _pairs(expected_names: dict, actual_names: dict):
    """(name, Accelerate's description, hasten's) for every name, and ("Class.method", ...) for every method of the
    classes hasten has (a missing class is one difference, not one per method)."""
    for name, expected in expected_names.items():
        actual = actual_names[name]
        methods, actual_methods = expected.get("methods", {}), actual.get("methods", {})
        yield (
            name,
            {k: v for k, v in expected.items() if k != "methods"},
            {k: v for k, v in actual.items() if k != "methods"},
        )
        if actual["kind"] != "class":
            continue
        for method, signature in methods.items():
            theirs = actual_methods.get(method, "missing")
            mine = {"kind": "missing"} if theirs == "missing" else {"kind": "function", "signature": theirs}
            yield f"{name}.{method}", {"kind": "function", "signature": signature}, mine


def _differences(reference: dict, ours: dict) -> tuple[list[str], set[tuple[str, str]]]:
    problems, used = [], set()
    for module, names in reference.items():
        if module in REFERENCE_NEEDS_OPTIONAL or module == "__properties__":
            continue
        if "__import_error__" in names:
            raise AssertionError(f"the reference module {module} did not import: {names['__import_error__']}")
        if "__import_error__" in ours[module]:
            problems.append(f"{module}: hasten has no such module ({ours[module]['__import_error__']})")
            continue
        for name, expected, actual in _pairs(names, ours[module]):
            if actual == expected:
                continue
            key = (module, name)
            entry = _allowed(module, name)
            ok = entry is not None and (
                (entry["difference"] == "missing" and actual["kind"] == "missing")
                or (entry["difference"] == "extra_params" and _extra_params_only(expected, actual))
                or (entry["difference"] == "differs" and actual["kind"] == expected["kind"])
            )
            if ok:
                used.add(key)
            else:
                problems.append(
                    f"{module}.{name}:\n    accelerate: {json.dumps(expected)}\n    hasten:     {json.dumps(actual)}"
                )
    return problems, used


@requires("reference")
def test_every_public_name_and_signature_matches_accelerate(surfaces):
    reference, ours = surfaces
    problems, _ = _differences(reference, ours)
    assert not problems, (
        f"{len(problems)} differences from Accelerate 1.15 that are not in the allow-list:\n" + "\n".join(problems)
    )


@requires("reference")
def test_instances_have_every_property_of_accelerate(surfaces):
    reference, ours = surfaces
    assert all(reference["__properties__"].values()), "the reference dump found no properties; the check is broken"
    missing = {path: names for path, names in ours["__missing_properties__"].items() if names}
    assert not missing, f"properties Accelerate's instances have and hasten's lack: {missing}"


@requires("reference")
def test_allow_list_holds_no_stale_entry(surfaces):
    reference, ours = surfaces
    _, used = _differences(reference, ours)
    listed = {key for entry in ALLOWED for key in entry["names"] if key[0] != "*"}
    stale = sorted(listed - used)
    assert not stale, (
        f"these names now match Accelerate (or no longer exist there); remove them from the allow-list: {stale}"
    )
    for _, pattern in {key for entry in ALLOWED for key in entry["names"] if key[0] == "*"}:
        prefix = pattern[:-1] if pattern.endswith(".*") else None
        assert any(name == pattern or (prefix and name.startswith(prefix)) for _, name in used), (
            f"the allow-list entry {pattern!r} is no longer needed"
        )


def test_allow_list_is_small_and_explained():
    assert len(ALLOWED) <= 20
    assert all(entry["reason"] and entry["difference"] in ("missing", "extra_params", "differs") for entry in ALLOWED)
    documented = (ROOT / "docs" / "migration.md").read_text()
    assert "Deliberate differences from Accelerate's surface" in documented
    for entry in ALLOWED:
        for module, name in entry["names"]:
            word = name.split(".")[0] if name.endswith(".*") else name.split(".")[-1]
            assert re.search(rf"\b{re.escape(word)}\b", documented), (
                f"docs/migration.md does not mention the allowed difference {module}.{name}"
            )
