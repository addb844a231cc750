"""The suite's fixtures and hooks: a fresh state for every test (and no process group left behind by one), skips
through ``helpers.requires``, generated cases sampled unless ``--all-cases``, CPU time per test (``--cpu-durations``),
and no process left behind.

``make test`` runs the tests on pytest-xdist workers with ``--dist loadfile``: the tests of a file stay on one worker,
in their order, so a module-scoped fixture (a launch, a venv) is built once and a module written as one scenario in
steps runs as written. (``--dist loadgroup``'s ``xdist_group`` marks have no effect with pytest 9: pytest-xdist 3.8
renames ``item._nodeid``, which pytest 9 no longer reads.) The files with the most tests marked slow (the ones that
launch processes) come first, so that the workers do not end on them one beside an idle one: collected in name order,
tests/test_examples.py (about 3 minutes on one worker) came last. Tests marked ``serial`` run after, alone."""

import os
import resource
import sys
from collections import defaultdict

import helpers
import pytest

import hasten.state


def pytest_addoption(parser):
    group = parser.getgroup("hasten")
    group.addoption(
        "--all-cases",
        action="store_true",
        help="run every generated case of the differential and generated tests (make test-all); by default a sample",
    )
    group.addoption(
        "--cpu-durations",
        type=int,
        default=None,
        metavar="N",
        help="list the N tests that took the most CPU time (the test's process and the processes it waited for) and "
        "the CPU and wall time of every test file; 0 lists files only",
    )


def pytest_configure(config):
    """The suite is written for CPU processes over gloo: on a GPU machine it hides the GPUs (before CUDA starts),
    unless the run selects the GPU tests (``pytest -m cuda``). DeepSpeed's compiled ops are looked up in the venv's
    own folder, where ``make setup`` built them, also when pytest is started by hand."""
    if "cuda" not in (config.option.markexpr or ""):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
    scripts = os.path.dirname(sys.executable)
    others = [entry for entry in os.environ.get("PATH", "").split(os.pathsep) if entry and entry != scripts]
    os.environ["PATH"] = os.pathsep.join([scripts, *others])
    helpers.ALL_CASES = config.getoption("--all-cases")
    if config.getoption("--cpu-durations") is not None:
        config.pluginmanager.register(_CpuTimes(config.getoption("--cpu-durations")), "hasten-cpu-durations")


def pytest_collection_modifyitems(items):
    """The files with the most slow tests first (stable: each file's tests keep their order)."""
    slow = defaultdict(int)
    for item in items:
        slow[item.path] += item.get_closest_marker("slow") is not None
    items.sort(key=lambda item: -slow[item.path])


def pytest_runtest_setup(item):
    """Skip a test whose needs (``helpers.requires``; ``cuda``-marked tests need a CUDA device) are not met here."""
    needs = [need for mark in item.iter_markers("requires") for need in mark.args]
    if item.get_closest_marker("cuda") is not None:
        needs.append("cuda")
    for need in dict.fromkeys(needs):
        reason = helpers.missing(need)
        if reason is not None:
            pytest.skip(reason)


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
    _no_process_group_left()


def _no_process_group_left() -> None:
    """A default process group the test started itself and left behind is ended, and the test fails: the next test
    of the same worker would find it and take another path (a state that joins a group instead of making none)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail(
            "the test left a default process group behind: end it (dist.destroy_process_group()) or reset "
            "hasten's state with reset_state(destroy_process_group=True)",
            pytrace=False,
        )


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


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class _CpuTimes:
    """``--cpu-durations``: each test's CPU seconds (this process's, and those of the processes it started and waited
    for: torchrun's workers count through torchrun) from its setup to its teardown, carried in the report's
    ``user_properties`` (so pytest-xdist brings them to the main process) and summed per file at the end. CPU time
    depends much less than wall time on what else the machine runs."""

    def __init__(self, top: int):
        self.top = top
        self.tests: list[tuple[float, float, str]] = []
        self.walls: dict[str, float] = defaultdict(float)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        item.stash[_START] = _cpu_seconds()
        yield

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        if call.when == "teardown" and _START in item.stash:
            outcome.get_result().user_properties.append(("cpu_s", round(_cpu_seconds() - item.stash[_START], 3)))

    def pytest_runtest_logreport(self, report):
        self.walls[report.nodeid] += report.duration
        cpu = dict(report.user_properties).get("cpu_s") if report.when == "teardown" else None
        if cpu is not None:
            self.tests.append((cpu, self.walls[report.nodeid], report.nodeid))

    def pytest_terminal_summary(self, terminalreporter):
        files: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
        for cpu, wall, nodeid in self.tests:
            row = files[nodeid.split("::")[0]]
            row[0], row[1], row[2] = row[0] + cpu, row[1] + wall, row[2] + 1
        write = terminalreporter.write_line
        terminalreporter.section("CPU and wall seconds per test file (setup to teardown), tests")
        for path, (cpu, wall, count) in sorted(files.items(), key=lambda kv: -kv[1][0]):
            write(f"{cpu:9.1f} {wall:9.1f} {count:5d}  {path}")
        totals = [sum(row[i] for row in files.values()) for i in range(3)]
        write(f"{totals[0]:9.1f} {totals[1]:9.1f} {totals[2]:5d}  total")
        if self.top:
            terminalreporter.section(f"the {self.top} tests that took the most CPU seconds (CPU, wall)")
            for cpu, wall, nodeid in sorted(self.tests, reverse=True)[: self.top]:
                write(f"{cpu:9.1f} {wall:9.1f}  {nodeid}")


_START = pytest.StashKey[float]()
