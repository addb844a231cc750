"""Helpers for tests that start real processes."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent / "scripts"
FIXTURES_ROOT = Path(__file__).resolve().parent / "fixtures"


def requires(package: str, extra: str | None = None):
    """Skip marker for a test that needs an optional ``package``, saying how to install it."""
    import pytest

    hint = f"pip install 'hasten[{extra}]'" if extra else f"pip install {package}"
    return pytest.mark.skipif(importlib.util.find_spec(package) is None, reason=f"{package} is not installed ({hint})")


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    """The current environment without launcher/hasten variables, plus ``extra``."""
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in drop and not k.startswith(("HASTEN_", "ACCELERATE_", "OMPI_", "PMI_", "SLURM_"))
    }
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    env.update(extra)
    return env


def torchrun(
    script: str | Path, *args: str, nproc: int = 2, env: dict | None = None, timeout: float = 240, check: bool = True
) -> subprocess.CompletedProcess:
    """Run ``script`` on ``nproc`` processes with ``python -m torch.distributed.run``; fail with its output on error."""
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
        str(script),
        *args,
    ]
    return _run(cmd, env, timeout, check)


def hasten_launch(
    script: str | Path,
    *args: str,
    launch_args: tuple[str, ...] = ("--num_processes", "2"),
    env: dict | None = None,
    timeout: float = 240,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """Run ``script`` with ``hasten launch`` (``--main_process_port`` set to a free port)."""
    cmd = [
        sys.executable,
        "-m",
        "hasten.commands.main",
        "launch",
        *launch_args,
        "--main_process_port",
        str(free_port()),
        str(script),
        *args,
    ]
    return _run(cmd, env, timeout, check)


def _run(cmd, env, timeout, check) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        cmd, env=env if env is not None else clean_env(), cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"command failed ({proc.returncode}): {' '.join(map(str, cmd))}\n--- stdout "
            f"---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-8000:]}"
        )
    return proc


def read_scalars(run_dir) -> list[tuple[str, int, float]]:
    """Every scalar event under ``run_dir`` (all event files, sub-folders included) as (tag, step, value)."""
    import glob

    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.util import tensor_util

    found = []
    for path in sorted(glob.glob(os.path.join(run_dir, "**", "events.out.tfevents.*"), recursive=True)):
        run = os.path.relpath(os.path.dirname(path), run_dir)
        for event in EventFileLoader(path).Load():
            for value in event.summary.value:
                if value.metadata.plugin_data.plugin_name == "scalars":
                    tag = value.tag if run == "." else f"{run}:{value.tag}"
                    found.append((tag, event.step, float(tensor_util.make_ndarray(value.tensor))))
    return found


def assert_numbers_match(actual, expected, dtype, where: str = "result") -> None:
    """``actual`` equals ``expected`` (nested dicts/lists of numbers and strings), floats within ``dtype``'s tolerance.

    For numbers recorded on another machine: the same float32 computation can differ in the last bits between CPUs
    (vectorised reductions sum in another order), so floats are compared with torch's default tolerances for
    ``dtype``; everything else must be equal.
    """
    import math

    import torch

    rtol, atol = {torch.float16: (1e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5), torch.float32: (1.3e-6, 1e-5)}.get(
        dtype, (1e-7, 1e-7)
    )
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys(), (
            f"{where}: keys {sorted(actual)} != {sorted(expected)}"
        )
        for key in expected:
            assert_numbers_match(actual[key], expected[key], dtype, f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)) and len(actual) == len(expected), (
            f"{where}: {actual!r} != {expected!r}"
        )
        for index, (a, e) in enumerate(zip(actual, expected)):
            assert_numbers_match(a, e, dtype, f"{where}[{index}]")
    elif isinstance(expected, float) and not isinstance(actual, bool) and isinstance(actual, (int, float)):
        assert math.isclose(actual, expected, rel_tol=rtol, abs_tol=atol), (
            f"{where}: {actual!r} != {expected!r} (rtol {rtol}, atol {atol})"
        )
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"
