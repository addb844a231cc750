"""hasten.test_utils: Accelerate's test helpers (``accelerate.test_utils``) for suites written against Accelerate."""

from __future__ import annotations

import sys
import unittest
from unittest import mock

import pytest
import torch

from hasten import test_utils
from hasten.errors import NotSupportedError
from hasten.runtime.availability import is_transformers_available
from hasten.test_utils import testing
from hasten.test_utils.training import RegressionDataset, RegressionModel, mocked_dataloaders


def _run(case_class) -> unittest.TestResult:
    result = unittest.TestResult()
    unittest.defaultTestLoader.loadTestsFromTestCase(case_class).run(result)
    return result


def test_regression_dataset_is_seeded_and_follows_the_line():
    first, again, other = (
        RegressionDataset(length=32, seed=7),
        RegressionDataset(length=32, seed=7),
        RegressionDataset(length=32, seed=8),
    )
    assert len(first) == 32 and first[3]["x"].dtype.name == "float32"
    assert (first.x == again.x).all() and (first.y == again.y).all() and not (first.x == other.x).all()
    residual = first.y - (2 * first.x + 3)
    assert abs(float(residual.mean())) < 0.1 and float(residual.std()) < 0.2


def test_regression_model_computes_ax_plus_b_and_reports_dtypes_once():
    model = RegressionModel(a=2, b=3)
    x = torch.tensor([1.0, 2.0])
    printed = testing.capture_call_output(model, x)
    assert printed == "Model dtype: torch.float32, torch.float32. Input dtype: torch.float32\n"
    assert torch.equal(model(x), torch.tensor([5.0, 7.0])) and testing.capture_call_output(model, x) == ""
    with pytest.raises(NotSupportedError, match="Hub"):
        mocked_dataloaders(None)


def test_require_decorators_skip_by_hardware_and_package(monkeypatch):
    class Case(unittest.TestCase):
        @testing.require_cpu
        def test_cpu(self):
            pass

        @testing.require_cuda
        def test_cuda(self):
            pass

        @testing.require_npu
        def test_npu(self):
            pass

        @testing.require_torch_min_version(version="999.0")
        def test_future_torch(self):
            pass

        @testing.require_transformers
        def test_transformers(self):
            pass

    result = _run(Case)
    skipped = {test.id().rsplit(".", 1)[1]: reason for test, reason in result.skipped}
    assert ("test_cuda" in skipped) is (not torch.cuda.is_available())
    assert ("test_cpu" in skipped) is (testing.torch_device != "cpu")
    assert "hasten does not support" in skipped["test_npu"] and "torch >= 999.0" in skipped["test_future_torch"]
    assert ("test_transformers" in skipped) is (not is_transformers_available())
    monkeypatch.setattr(testing, "_run_slow_tests", False)
    assert getattr(testing.slow(lambda: None), "__unittest_skip__", False)
    monkeypatch.setattr(testing, "_run_slow_tests", True)
    assert not getattr(testing.slow(lambda: None), "__unittest_skip__", False)


def test_test_cases_give_a_clean_folder_reset_the_state_and_stop_mocks():
    seen = []

    class Folder(testing.TempDirTestCase):
        def test_a(self):
            (self.tmpdir / "leftover.txt").write_text("x")
            seen.append(self.tmpdir)

        def test_b(self):
            assert list(self.tmpdir.iterdir()) == []

    class State(testing.AccelerateTestCase):
        def test_state(self):
            from hasten.state import PartialState

            PartialState(cpu=True)

    class Mocks(testing.MockingTestCase):
        def test_mock(self):
            self.add_mocks(mock.patch.object(sys, "platform", "mocked"))
            assert sys.platform == "mocked"

    for case in (Folder, State, Mocks):
        result = _run(case)
        assert result.wasSuccessful(), result.failures + result.errors
    assert not seen[0].exists() and sys.platform != "mocked"
    from hasten.state import PartialState

    assert not PartialState._shared_state


def test_subprocess_helpers(tmp_path):
    ok = testing.execute_subprocess_async([sys.executable, "-c", "print('hello')"], quiet=True, echo=False)
    assert ok.returncode == 0 and ok.stdout == ["hello"]
    with pytest.raises(RuntimeError, match="boom"):
        testing.execute_subprocess_async([sys.executable, "-c", "import sys; sys.exit('boom')"], quiet=True, echo=False)
    assert testing.run_command([sys.executable, "-c", "print(42)"], return_stdout=True) == "42\n"
    with pytest.raises(testing.SubprocessCallException, match="nope"):
        testing.run_command([sys.executable, "-c", "raise SystemExit('nope')"])


def test_paths_ports_and_launch_command(monkeypatch):
    assert testing.path_in_accelerate_package("test_utils", "scripts", "test_script.py").is_file()
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw3")
    assert testing.pytest_xdist_worker_id() == 3 and testing.get_torch_dist_unique_port() == 29503
    monkeypatch.delenv("PYTEST_XDIST_WORKER")
    assert testing.pytest_xdist_worker_id() == 0
    command = test_utils.get_launch_command(num_processes=2, cpu=True, debug=False)
    assert command == [sys.executable, "-m", "hasten.commands.main", "launch", "--num_processes", "2", "--cpu"]


def test_assert_exception_and_same_tensors():
    with testing.assert_exception(ValueError, "bad value"):
        raise ValueError("a bad value")
    with pytest.raises(AssertionError, match="lacks"):
        with testing.assert_exception(ValueError, "other"):
            raise ValueError("a bad value")
    with pytest.raises(AssertionError, match="to be raised"):
        with testing.assert_exception(ValueError):
            pass
    from hasten.state import PartialState

    PartialState(cpu=True)
    assert testing.are_the_same_tensors(torch.tensor([1.0, 2.0]))


@pytest.mark.slow
def test_the_operations_script_checks_every_process():
    from hasten.launchers import debug_launcher

    test_utils.test_ops.main()  # one process: every operation gives the process's own values back
    with mock.patch.object(test_utils.test_ops, "reduce", lambda tensor, reduction="mean", scale=1.0: tensor * 0):
        with pytest.raises(AssertionError, match=r"reduce\(sum\) gave \[0.0, 0.0\]"):
            test_utils.test_ops.check_reduce(test_utils.test_ops.PartialState())
    from hasten.state import reset_state

    reset_state()
    debug_launcher(test_utils.test_ops.main)  # two processes, as Accelerate's test_cpu.py runs it


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2])
def test_the_gradient_sync_script_checks_every_process(processes):
    from hasten.launchers import debug_launcher

    with mock.patch.object(test_utils.test_sync, "_agree", lambda model: True):
        if processes > 1:  # gradients that agree inside no_sync mean no_sync did nothing: the check must say so
            with pytest.raises(Exception, match="gradients agree across processes"):
                debug_launcher(test_utils.test_sync.main, num_processes=processes)
    debug_launcher(test_utils.test_sync.main, num_processes=processes)
