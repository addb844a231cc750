"""Differential tests: the same generated scenario on the reference copy of Accelerate 1.15 and on hasten.

A scenario is a plain function ``scenario(case: dict)`` in a module under ``tests/`` that imports ``accelerate``
and returns anything. It runs twice, each time in a fresh subprocess (one subprocess runs a whole list of cases):
once with the reference copy (``.reference/accelerate-1.15.0``, installed by ``make reference``; a test that runs it
is marked ``requires("reference")``) first on ``PYTHONPATH``, once with hasten answering ``import accelerate`` (the
launcher's shim folder first on ``PYTHONPATH``), so one scenario text drives both.
:func:`describe` turns what a case returned, raised and warned into plain JSON; :func:`differences` compares the two
sides:

- values: equal (tensors: dtype, shape, device type and values; floats exactly unless the caller gives ``atol``);
- an exception: hasten's must be an instance of the reference's type (a subclass with a clearer message is fine);
- warnings: the same set of ``warnings.warn`` categories.

Cases are JSON dicts generated from a seed; a failing case is reported with a one-line command that reruns it on
both sides and prints the two results::

    .venv/bin/python tests/differential.py MODULE:FUNCTION '{"seed": 7, ...}' [--nproc 2]

Multi-process scenarios (``nproc`` > 1) run under ``torch.distributed.run`` with ``ACCELERATE_USE_CPU=1`` on both
sides: without it Accelerate gives each CPU process a world of its own (a scenario that builds ``PartialState``
itself passes ``cpu=True`` for the same reason). Each rank's result is compared.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
REFERENCE = ROOT / ".reference" / "accelerate-1.15.0"
SHIM = ROOT / "src" / "hasten" / "_accelerate_shim"
DRIVER = TESTS / "scripts" / "differential_driver.py"
SIDES = ("accelerate", "hasten")


def side_env(side: str) -> dict[str, str]:
    """The environment of a subprocess in which ``import accelerate`` is the reference copy or hasten."""
    from helpers import clean_env

    if side == "accelerate":
        path = [REFERENCE, TESTS]
    elif side == "hasten":
        path = [SHIM, ROOT / "src", TESTS]
    else:
        raise ValueError(f"side must be one of {SIDES}, not {side!r}")
    return clean_env(PYTHONPATH=os.pathsep.join(map(str, path)), HASTEN_DIFFERENTIAL_SIDE=side)


def run_side(side: str, scenario: str, cases: list[dict], nproc: int = 1, timeout: float = 600) -> list:
    """Run ``scenario`` ("module:function") on every case on one side; one result per case, or per rank and case."""
    from helpers import free_port

    with tempfile.TemporaryDirectory(prefix=f"differential-{side}-") as tmp:
        spec = Path(tmp) / "cases.json"
        spec.write_text(json.dumps({"scenario": scenario, "cases": cases}))
        out = Path(tmp) / "results"
        if nproc == 1:
            cmd = [sys.executable, str(DRIVER), str(spec), str(out)]
        else:
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc_per_node",
                str(nproc),
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                str(free_port()),
                str(DRIVER),
                str(spec),
                str(out),
            ]
        env = side_env(side)
        if nproc > 1:  # Accelerate starts a gloo group for torchrun's processes only when told to use the CPU
            env["ACCELERATE_USE_CPU"] = "1"
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise AssertionError(
                f"{scenario} on {side} exited {proc.returncode}\n--- stdout ---\n{proc.stdout[-4000:]}\n"
                f"--- stderr ---\n{proc.stderr[-8000:]}"
            )
        per_rank = [json.loads((Path(f"{out}.rank{rank}.json")).read_text()) for rank in range(nproc)]
    return per_rank[0] if nproc == 1 else [list(row) for row in zip(*per_rank)]


def repro_line(scenario: str, case: dict, nproc: int = 1) -> str:
    """The command that reruns one case on both sides and prints the results."""
    extra = f" --nproc {nproc}" if nproc != 1 else ""
    return f".venv/bin/python tests/differential.py {scenario} '{json.dumps(case)}'{extra}"


def compare_sides(
    scenario: str, cases: list[dict], nproc: int = 1, atol: float = 0.0, timeout: float = 600
) -> list[str]:
    """Run every case on both sides and return one line per case that differs (with its seed and repro command)."""
    ours = run_side("hasten", scenario, cases, nproc, timeout)
    theirs = run_side("accelerate", scenario, cases, nproc, timeout)
    failures = []
    for case, reference, result in zip(cases, theirs, ours):
        if nproc == 1:
            found = differences(reference, result, atol=atol)
        else:
            found = [
                f"rank {rank}: {line}"
                for rank, (r, o) in enumerate(zip(reference, result))
                for line in differences(r, o, atol)
            ]
        if found:
            failures.append(f"case {case}: {'; '.join(found[:4])}\n    repro: {repro_line(scenario, case, nproc)}")
    return failures


def assert_same(scenario: str, cases: list[dict], nproc: int = 1, atol: float = 0.0, timeout: float = 600) -> None:
    """Fail with every differing case (at most 20 shown) when hasten and Accelerate disagree on any case."""
    failures = compare_sides(scenario, cases, nproc, atol, timeout)
    if failures:
        shown = "\n".join(failures[:20])
        raise AssertionError(
            f"{len(failures)} of {len(cases)} cases of {scenario} differ from Accelerate 1.15:\n{shown}"
        )


def describe(value):
    """``value`` as plain JSON: tensors, dtypes, devices, containers (their type kept), numbers, strings."""
    import torch

    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return {"int": value} if abs(value) >= 2**53 else value
    if isinstance(value, float):
        return {"float": repr(value)} if not math.isfinite(value) else value
    if isinstance(value, torch.Tensor):
        return _describe_tensor(value)
    if isinstance(value, (torch.dtype, torch.device)):
        return {type(value).__name__: str(value)}
    if isinstance(value, dict):
        return {"dict": type(value).__name__, "items": [[describe(k), describe(v)] for k, v in value.items()]}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
        return {"seq": type(value).__name__, "items": [describe(v) for v in items]}
    if type(value).__module__ == "numpy":
        return {"numpy": str(getattr(value, "dtype", type(value).__name__)), "value": describe(value.tolist())}
    return {"object": type(value).__name__}


def _describe_tensor(tensor) -> dict:
    out = {"tensor": str(tensor.dtype), "shape": list(tensor.shape), "device": tensor.device.type}
    if tensor.device.type == "meta":
        return out
    values = tensor.detach().cpu().flatten()
    if values.is_floating_point() or values.is_complex():
        out["values"] = [v if math.isfinite(v) else repr(v) for v in values.double().tolist()]
    else:
        out["values"] = values.tolist()
    return out


def describe_outcome(function, case: dict) -> dict:
    """Run ``function(case)``: what it returned (described) or the exception raised, and the warning categories."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            outcome = {"returned": describe(function(case))}
        except Exception as error:  # noqa: BLE001 - the exception is the result being compared
            outcome = {"raised": [cls.__name__ for cls in type(error).__mro__], "message": str(error)[:300]}
    outcome["warnings"] = sorted({w.category.__name__ for w in caught})
    return outcome


def differences(reference: dict, ours: dict, atol: float = 0.0) -> list[str]:
    """Where hasten's outcome differs from the reference's (empty when they agree)."""
    found = []
    if "raised" in reference or "raised" in ours:
        if "raised" not in ours:
            found.append(f"Accelerate raised {reference['raised'][0]} ({reference['message']!r}), hasten returned")
        elif "raised" not in reference:
            found.append(f"hasten raised {ours['raised'][0]} ({ours['message']!r}), Accelerate returned")
        elif reference["raised"][0] not in ours["raised"]:
            found.append(
                f"Accelerate raised {reference['raised'][0]}, hasten raised {ours['raised'][0]} (not a subclass)"
            )
    else:
        _compare_values(reference["returned"], ours["returned"], "result", atol, found)
    if reference["warnings"] != ours["warnings"]:
        found.append(f"warnings: Accelerate {reference['warnings']}, hasten {ours['warnings']}")
    return found


def _compare_values(expected, actual, where: str, atol: float, found: list[str]) -> None:
    if isinstance(expected, dict) and isinstance(actual, dict) and "values" in expected and "values" in actual:
        head = {k: v for k, v in expected.items() if k != "values"}
        if head != {k: v for k, v in actual.items() if k != "values"}:
            found.append(f"{where}: Accelerate {head}, hasten { {k: v for k, v in actual.items() if k != 'values'} }")
        elif not _close(expected["values"], actual["values"], atol):
            found.append(
                f"{where}: values differ (Accelerate {expected['values'][:6]}..., hasten {actual['values'][:6]}...)"
            )
        return
    if isinstance(expected, dict) and isinstance(actual, dict) and "items" in expected and "items" in actual:
        if {k: v for k, v in expected.items() if k != "items"} != {
            k: v for k, v in actual.items() if k != "items"
        } or len(expected["items"]) != len(actual["items"]):
            found.append(f"{where}: Accelerate {_short(expected)}, hasten {_short(actual)}")
            return
        for index, (e, a) in enumerate(zip(expected["items"], actual["items"])):
            _compare_values(e, a, f"{where}[{index}]", atol, found)
        return
    if (
        isinstance(expected, list) and isinstance(actual, list) and len(expected) == len(actual)
    ):  # a dict's [key, value]
        for index, (e, a) in enumerate(zip(expected, actual)):
            _compare_values(e, a, f"{where}.{index}", atol, found)
        return
    if isinstance(expected, float) and isinstance(actual, float) and abs(expected - actual) <= atol:
        return
    if expected != actual:
        found.append(f"{where}: Accelerate {_short(expected)}, hasten {_short(actual)}")


def _close(expected: list, actual: list, atol: float) -> bool:
    if len(expected) != len(actual):
        return False
    for e, a in zip(expected, actual):
        if isinstance(e, float) and isinstance(a, float):
            if abs(e - a) > atol:
                return False
        elif e != a:
            return False
    return True


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 160 else text[:157] + "..."


def _main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Rerun one differential case on Accelerate 1.15 and on hasten.")
    parser.add_argument("scenario", help="module:function, the module importable from tests/")
    parser.add_argument("case", help="the case, as JSON")
    parser.add_argument("--nproc", type=int, default=1)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(TESTS))
    case = json.loads(args.case)
    for side in SIDES:
        print(f"--- {side} ---")
        print(json.dumps(run_side(side, args.scenario, [case], args.nproc)[0], indent=1)[:20000])
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
