"""What every hasten collective checks across processes, and the stack dumps of hang reports (one process each)."""

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from helpers import ROOT, requires

from hasten.runtime import collective_check, stack_dump

_SRC = os.path.join(os.path.dirname(__file__), "..", "..", "src")


@pytest.mark.slow
def test_the_digest_is_the_same_in_every_process():
    code = (
        "import torch; from hasten.runtime import collective_check as c; "
        "print(c.digest(c.same_tensors({'b': torch.ones(2, 3), 'a': (torch.zeros(1, dtype=torch.int64),)})), "
        "c.operation_code('gather'))"
    )
    outputs = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": os.path.abspath(_SRC)}
        outputs.add(
            subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
        )
    assert len(outputs) == 1, outputs


def test_what_must_agree():
    same = collective_check.same_tensors
    assert same(torch.ones(2, 3)) == same(torch.zeros(2, 3))
    assert same(torch.ones(2, 3)) != same(torch.ones(3, 3))
    assert same(torch.ones(2)) != same(torch.ones(2, dtype=torch.float64))
    assert same({"a": torch.ones(1)}) != same({"b": torch.ones(1)})
    assert same((torch.ones(1), torch.ones(1))) != same((torch.ones(1),))
    ranks = collective_check.same_ranks
    assert ranks(torch.ones(2, 3)) == ranks(torch.ones(5, 7, dtype=torch.int64))
    assert ranks(torch.ones(2, 3)) != ranks(torch.ones(2))
    trailing = collective_check.same_trailing
    assert trailing(torch.ones(2, 3), lambda t: True) == trailing(torch.ones(5, 3), lambda t: True)
    assert trailing(torch.ones(2, 3), lambda t: True) != trailing(torch.ones(2, 4), lambda t: True)


def test_descriptions_name_shapes_and_dtypes():
    data = {"preds": torch.ones(10, 4), "labels": [torch.ones(10, dtype=torch.int64)]}
    assert collective_check.describe(data) == "{'preds': [10, 4] float32, 'labels': [[10] int64]}"
    assert collective_check.describe((torch.ones(()), "text")) == "([] float32, str)"


@pytest.mark.serial
def test_a_process_holding_the_gil_in_c_code_gives_its_stacks(tmp_path):
    script = tmp_path / "hold.py"
    script.write_text(
        textwrap.dedent("""
        from hasten.runtime import stack_dump

        def hold_the_gil():
            return sum(range(10**15))

        print(stack_dump.install(), flush=True)
        hold_the_gil()
    """)
    )
    env = {**os.environ, "PYTHONPATH": os.path.abspath(_SRC)}
    with subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True) as proc:
        try:
            path = proc.stdout.readline().strip()
            time.sleep(0.5)  # let it enter the C loop
            stacks = stack_dump.dump_other(proc.pid, path)
        finally:
            proc.kill()
    assert stacks is not None and "in hold_the_gil" in stacks, stacks


@pytest.mark.serial
@requires("fork")
def test_forked_children_are_named_with_their_stacks():
    path = stack_dump.install()
    assert path is not None and stack_dump.dump_path() == path
    child = os.fork()
    if child == 0:  # the child sleeps in Python until it is killed
        while True:
            time.sleep(0.05)
    try:
        time.sleep(0.3)
        described = stack_dump.describe_children(os.getpid(), path)
    finally:
        os.kill(child, 9)
        os.waitpid(child, 0)
    assert f"Child process {child}" in described and "a fork of this process" in described, described
    assert "test_forked_children_are_named_with_their_stacks" in described, described


@pytest.mark.serial
def test_a_process_without_the_handler_is_not_signalled(tmp_path):
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"]) as proc:
        try:
            time.sleep(0.3)
            assert stack_dump.dump_other(proc.pid, str(tmp_path / "none.txt")) is None
            assert proc.poll() is None  # SIGUSR2 would have ended it
        finally:
            proc.kill()


def test_a_process_forked_after_a_destroyed_group_runs_its_collectives():
    # The check's view of the default group held it strongly: after destroy_process_group the group stayed alive, and
    # the debug launcher's forked workers destroyed their copy of it when they replaced the view, aborting
    # (std::system_error) or crashing (SIGSEGV) before their first collective. make test's workers hit it whenever an
    # in-process test of the same worker had used a group.
    code = textwrap.dedent(
        """
        import os
        import torch
        import torch.distributed as dist
        from helpers import free_port
        from hasten.launchers import debug_launcher
        from hasten.runtime import operations
        from hasten.test_utils.scripts import test_ops

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
        assert operations.gather(torch.ones(2)).tolist() == [1.0, 1.0]
        dist.destroy_process_group()
        debug_launcher(test_ops.main, num_processes=2)
        print("forked workers done")
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "forked workers done" in run.stdout, run.stderr[-4000:]
