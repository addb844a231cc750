import os
import sys

import pytest

import hasten.state


def pytest_configure(config):
    """The suite is written for CPU processes over gloo: on a GPU machine it hides the GPUs (before CUDA starts),
    unless the run selects the GPU tests (``pytest -m cuda``). DeepSpeed's compiled ops are looked up in the venv's
    own folder, where ``make setup`` built them, also when pytest is started by hand."""
    if "cuda" not in (config.option.markexpr or ""):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))


@pytest.fixture(autouse=True)
def _fresh_state(monkeypatch):
    """Every test starts with no hasten state and no launcher variables, and leaves none behind: the environment
    is restored as it was, also where the code under test wrote ``os.environ`` itself (``PrepareForLaunch`` does)."""
    saved = dict(os.environ)
    for key in list(os.environ):
        if key.startswith(("HASTEN_", "ACCELERATE_", "OMPI_COMM_WORLD", "PMI_", "PMIX_", "SLURM_", "MV2_")) or key in (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
        ):
            monkeypatch.delenv(key, raising=False)
    hasten.state.reset_state(destroy_process_group=True)
    yield
    hasten.state.reset_state(destroy_process_group=True)
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


_HELPER_PROCESSES = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")
_GRACE_SECONDS = 5.0


def _leftover_children() -> list:
    """Processes started (directly or not) by this test session that are still running, after a grace period."""
    import psutil

    def alive() -> list:
        found = []
        for child in psutil.Process().children(recursive=True):
            try:
                if child.status() != psutil.STATUS_ZOMBIE and not any(
                    name in " ".join(child.cmdline()) for name in _HELPER_PROCESSES
                ):
                    found.append(child)
            except psutil.NoSuchProcess:
                pass
        return found

    left = alive()
    if left:
        psutil.wait_procs(left, timeout=_GRACE_SECONDS)
        left = alive()
    return left


def pytest_sessionfinish(session, exitstatus):
    """Fail the session if a test left a process behind (a worker that outlived its launcher, say), and end it."""
    import psutil

    left = _leftover_children()
    if not left:
        return
    lines = []
    for child in left:
        try:
            lines.append(f"  pid {child.pid}: {' '.join(child.cmdline())[:200]}")
            child.kill()
        except psutil.NoSuchProcess:
            pass
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    message = f"{len(left)} process(es) started by the tests were still running at the end (now killed):\n" + "\n".join(
        lines
    )
    if reporter is not None:
        reporter.write_line("")
        reporter.write_line(message, red=True)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
