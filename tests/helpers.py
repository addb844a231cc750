"""Helpers of the test suite: what a test needs to run (:func:`requires`, the suite's one way to skip), how many
generated cases it runs (:func:`cases`), and starting real processes (:func:`torchrun`, :func:`hasten_launch`) on
ports that parallel test workers never share (:func:`free_port`)."""

from __future__ import annotations

import functools
import importlib.util
import math
import os
import socket
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent / "scripts"
FIXTURES_ROOT = Path(__file__).resolve().parent / "fixtures"
REFERENCE = ROOT / ".reference" / "accelerate-1.15.0"

# ------------------------------------------------------------------------------------------------ what a test needs

_MAKE_SETUP = "`make setup` installs it"
# The optional packages tests may need (import name -> how to install it): a name missing here is a typo.
PACKAGES = {
    "deepspeed": "pip install 'hasten[deepspeed]'",
    "torchao": "pip install 'hasten[fp8]'",
    "tensorboard": "pip install 'hasten[tracking]'",
    "transformers": "pip install 'hasten[dev]'",
    "datasets": _MAKE_SETUP,
    "peft": _MAKE_SETUP,
    "trl": _MAKE_SETUP,
    "diffusers": _MAKE_SETUP,
    "sentence_transformers": _MAKE_SETUP,
    "setfit": _MAKE_SETUP,
    "sklearn": _MAKE_SETUP,
    "wandb": "pip install wandb",
    "mlflow": "pip install mlflow",
}


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _fp8_gpu() -> bool:
    import torch

    return _cuda() and torch.cuda.get_device_capability() >= (8, 9)


def _venv_script(name: str) -> Callable[[], bool]:
    return lambda: (Path(sys.executable).parent / name).exists()


@functools.lru_cache(maxsize=None)
def _tmpfs() -> bool:
    """Whether a tmpfs can be mounted here (root, and the right to mount): tried once, in a scratch folder."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", folder], capture_output=True).returncode:
            return False
        subprocess.run(["umount", "-l", folder], check=True)
    return True


def _torch_threads() -> bool:
    import torch

    return torch.get_num_threads() >= 2


def _distribution_version(name: str) -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return ""


# What else a test may need: name -> (whether it is here, what is missing and how to get it).
CONDITIONS: dict[str, tuple[Callable[[], bool], str]] = {
    "cuda": (_cuda, "needs a CUDA device"),
    "fp8 gpu": (_fp8_gpu, "needs a GPU with fp8 units (compute capability 8.9+)"),
    "pre-fp8 gpu": (lambda: _cuda() and not _fp8_gpu(), "needs a GPU without fp8 units (compute capability below 8.9)"),
    "fork": (lambda: hasattr(os, "fork"), "needs os.fork"),
    "reference": (
        lambda: (REFERENCE / "accelerate" / "__init__.py").is_file(),
        f"no reference copy of accelerate 1.15 in {REFERENCE} (`make reference` installs it; pip was offline?)",
    ),
    "accelerate command": (
        _venv_script("accelerate"),
        "the `accelerate` command is not installed in this venv (`make setup` installs hasten's alias)",
    ),
    "accelerate alias": (
        lambda: "+hasten." in _distribution_version("accelerate"),
        "hasten's accelerate distribution is not installed in this venv (`make setup` installs it)",
    ),
    "all cases": (
        lambda: ALL_CASES,
        "checks the whole set of generated cases: runs with --all-cases (make test-all)",
    ),
    "tmpfs": (_tmpfs, "cannot mount a tmpfs here (needs root and the right to mount)"),
    "linux thread scheduling": (
        lambda: hasattr(os, "sched_getscheduler"),
        "needs Linux's per-thread scheduling calls",
    ),
    "linux thread /proc": (lambda: os.path.isdir("/proc/self/task"), "needs Linux's per-thread /proc entries"),
    "torch thread pool": (_torch_threads, "torch runs one thread here: there is no thread pool to start"),
    "make demo installed": (
        lambda: (
            (ROOT / ".venv" / ".hasten-demo").is_file()
            and (ROOT / ".venv" / ".hasten-demo").stat().st_mtime >= (ROOT / "pyproject.toml").stat().st_mtime
        ),
        "the venv is older than pyproject.toml: `make demo` would reinstall hasten first (network)",
    ),
    "make venv": (
        lambda: (Path(sysconfig.get_paths()["purelib"]) / "hasten-torch-extensions.pth").is_file(),
        "this venv was not set up by `make` (no hasten-torch-extensions.pth)",
    ),
}


def requires(*needs: str):
    """The suite's one way to skip: a mark saying what a test needs beyond hasten's core install.

    Each need is an optional package's import name (a key of :data:`PACKAGES`) or a condition (a key of
    :data:`CONDITIONS`: ``"cuda"``, ``"reference"``, ...). Use it as a decorator, as a module's ``pytestmark`` or in
    ``pytest.param(..., marks=requires(...))``. The conftest checks the needs just before the test runs (so a check
    costs nothing for tests not selected) and skips it with a reason saying what is missing and how to get it; an
    unknown need fails the collection. Tests marked ``cuda`` need a CUDA device without saying so.
    """
    import pytest

    unknown = [need for need in needs if need not in PACKAGES and need not in CONDITIONS]
    if unknown:
        raise ValueError(f"requires{needs}: unknown {unknown}; add them to PACKAGES or CONDITIONS in helpers.py")
    return pytest.mark.requires(*needs)


def missing(need: str) -> str | None:
    """Why a test needing ``need`` cannot run here, or None when it can (see :func:`requires`)."""
    if need in PACKAGES:
        if importlib.util.find_spec(need) is None:
            return f"{need} is not installed ({PACKAGES[need]})"
        return None
    present, reason = CONDITIONS[need]
    return None if present() else reason


# ------------------------------------------------------------------------------------------------ generated cases

ALL_CASES = False  # set by the conftest from ``--all-cases`` (make test-all) before any test module is imported
SAMPLE_SHARE = 5  # the default run takes one generated case in SAMPLE_SHARE


def cases(count: int) -> int:
    """How many of a test's ``count`` generated cases to run: all with ``--all-cases`` (``make test-all``), else one
    in :data:`SAMPLE_SHARE` (at least one), generated from the same seed. A check that needs the whole set (every
    allowance still used) requires ``"all cases"``."""
    return count if ALL_CASES else max(1, math.ceil(count / SAMPLE_SHARE))


# Ports handed out by free_port: below Linux's ephemeral range (32768-60999), so that no socket connecting somewhere
# is given one between the check and its use, and a block of them per pytest-xdist worker (gw0, gw1, ...), so that
# parallel workers never pick the same one. The blocks end below 29500, torch's default port.
_PORT_BASE = 10000
_PORTS_PER_WORKER = 1000
_MAX_WORKERS = 19
_next_port: list[int] = []


def free_port() -> int:
    """A TCP port that is free now on 127.0.0.1, from this test worker's own block of ports.

    Each call returns another port of the block (cycling through it from a place chosen by the process id), checked
    free by binding it; two pytest-xdist workers never share a block, so they cannot hand out the same port.
    """
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    low = _PORT_BASE + (int(worker) if worker.isdigit() else 0) % _MAX_WORKERS * _PORTS_PER_WORKER
    if not _next_port:
        _next_port.append(os.getpid() % _PORTS_PER_WORKER)
    for _ in range(_PORTS_PER_WORKER):
        port = low + _next_port[0] % _PORTS_PER_WORKER
        _next_port[0] += 1
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free TCP port in {low}-{low + _PORTS_PER_WORKER - 1} on 127.0.0.1")


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
