"""Helpers for test suites of code built on hasten (Accelerate's ``accelerate.test_utils.testing``): skip decorators
by hardware and installed package, test-case bases that reset the state, subprocess runners, the launch command.
"""

from __future__ import annotations

import contextlib
import io
import shutil
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

import torch

from ..environment import parse_choice_from_env, parse_flag_from_env
from ..runtime import availability


def get_backend():
    """``(device type, device count, memory-allocated function)`` of the accelerator here (``"cpu"``, 1 and a
    function returning 0 without one)."""
    if availability.is_cuda_available():
        return "cuda", torch.cuda.device_count(), torch.cuda.memory_allocated
    if availability.is_mps_available(min_version="2.0"):
        return "mps", 1, torch.mps.current_allocated_memory
    if availability.is_xpu_available():
        return "xpu", torch.xpu.device_count(), torch.xpu.memory_allocated
    return "cpu", 1, lambda: 0


torch_device, device_count, memory_allocated_func = get_backend()


def get_launch_command(**kwargs) -> list:
    """``hasten launch`` as an argument list, with ``key=value`` turned into ``--key value``.

    ``True`` gives a bare switch (``--debug``); ``False`` and ``None`` are left out. It runs through this
    interpreter (``python -m hasten.commands.main launch``), so no ``hasten`` executable is needed on ``PATH``.

    Example::

        subprocess.run(get_launch_command(num_processes=2, cpu=True) + ["script.py"], check=True)
    """
    command = [sys.executable, "-m", "hasten.commands.main", "launch"]
    for key, value in kwargs.items():
        if value is True:
            command.append(f"--{key}")
        elif value not in (False, None):
            command += [f"--{key}", str(value)]
    return command


DEFAULT_LAUNCH_COMMAND = get_launch_command(num_processes=device_count, monitor_interval=0.1)

_run_slow_tests = parse_flag_from_env("RUN_SLOW", default=False)


def skip(test_case):
    """Skip the test unconditionally."""
    return unittest.skip("Test was skipped")(test_case)


def slow(test_case):
    """Mark a test as slow: skipped unless the ``RUN_SLOW`` variable is true."""
    return unittest.skipUnless(_run_slow_tests, "test is slow (set RUN_SLOW=1 to run it)")(test_case)


def _requiring(condition, reason: str):
    def decorator(test_case):
        return unittest.skipUnless(condition(), reason)(test_case)

    return decorator


def _gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _xpu_count() -> int:
    return torch.xpu.device_count() if availability.is_xpu_available() else 0


def require_cpu(test_case):
    """Run the test only when no accelerator is present."""
    return _requiring(lambda: torch_device == "cpu", "test requires only a CPU")(test_case)


def require_non_cpu(test_case):
    """Run the test only with an accelerator (CUDA, XPU or MPS)."""
    return _requiring(lambda: torch_device != "cpu", "test requires a GPU")(test_case)


def require_cuda(test_case):
    """Run the test only with a CUDA GPU."""
    return _requiring(availability.is_cuda_available, "test requires a CUDA GPU")(test_case)


def require_cuda_or_hpu(test_case):
    """Run the test only with a CUDA GPU (hasten does not support HPUs)."""
    return _requiring(availability.is_cuda_available, "test requires a CUDA GPU or an HPU")(test_case)


def require_xpu(test_case):
    """Run the test only with an Intel XPU."""
    return _requiring(availability.is_xpu_available, "test requires an XPU")(test_case)


def require_cuda_or_xpu(test_case):
    """Run the test only with a CUDA GPU or an Intel XPU."""
    return _requiring(
        lambda: availability.is_cuda_available() or availability.is_xpu_available(),
        "test requires a CUDA GPU or an XPU",
    )(test_case)


def require_non_xpu(test_case):
    """Skip the test on Intel XPUs."""
    return _requiring(lambda: torch_device != "xpu", "test requires a non-XPU device")(test_case)


def require_non_hpu(test_case):
    """Skip the test on HPUs (never the case with hasten)."""
    return _requiring(lambda: True, "test requires a non-HPU device")(test_case)


def require_fp16(test_case):
    """Run the test only where fp16 mixed precision works."""
    return _requiring(availability.is_fp16_available, "test requires fp16 support")(test_case)


def require_fp8(test_case):
    """Run the test only where fp8 training can run (a recent GPU and an fp8 back end)."""
    return _requiring(availability.is_fp8_available, "test requires fp8 support")(test_case)


def require_fsdp2(test_case):
    """Run the test only with FSDP2 (always available with the torch hasten requires)."""
    return _requiring(lambda: availability.is_torch_version(">=", "2.5.0"), "test requires FSDP2 (torch >= 2.5)")(
        test_case
    )


def _unsupported_device(name: str):
    def decorator(test_case):
        return unittest.skip(f"test requires {name}, which hasten does not support")(test_case)

    decorator.__doc__ = f"Skip the test: it needs {name}, which hasten does not support."
    return decorator


require_mlu = _unsupported_device("an MLU")
require_sdaa = _unsupported_device("an SDAA device")
require_musa = _unsupported_device("a MUSA GPU")
require_npu = _unsupported_device("an NPU")
require_neuron = _unsupported_device("a Neuron device")
require_tpu = _unsupported_device("a TPU")
require_tp = _unsupported_device("tensor parallelism")
require_pippy = _unsupported_device("pipeline-parallel inference")
require_transformer_engine = _unsupported_device("Transformer Engine")
require_transformer_engine_mxfp8 = _unsupported_device("Transformer Engine MXFP8")


def require_mps(test_case):
    """Run the test only with Apple's MPS backend."""
    return _requiring(availability.is_mps_available, "test requires MPS")(test_case)


def require_non_torch_xla(test_case):
    """Skip the test under torch_xla (never the case with hasten)."""
    return _requiring(lambda: True, "test requires an environment without torch_xla")(test_case)


def require_single_device(test_case):
    """Run the test only with exactly one accelerator."""
    return _requiring(lambda: torch_device != "cpu" and device_count == 1, "test requires a single device")(test_case)


def require_single_gpu(test_case):
    """Run the test only with exactly one CUDA GPU."""
    return _requiring(lambda: _gpu_count() == 1, "test requires a single GPU")(test_case)


def require_single_xpu(test_case):
    """Run the test only with exactly one XPU."""
    return _requiring(lambda: _xpu_count() == 1, "test requires a single XPU")(test_case)


def require_multi_device(test_case):
    """Run the test only with several accelerators."""
    return _requiring(lambda: device_count > 1 and torch_device != "cpu", "test requires multiple devices")(test_case)


def require_multi_gpu(test_case):
    """Run the test only with several CUDA GPUs."""
    return _requiring(lambda: _gpu_count() > 1, "test requires multiple GPUs")(test_case)


def require_multi_xpu(test_case):
    """Run the test only with several XPUs."""
    return _requiring(lambda: _xpu_count() > 1, "test requires multiple XPUs")(test_case)


def require_multi_gpu_or_xpu(test_case):
    """Run the test only with several CUDA GPUs or XPUs."""
    return _requiring(lambda: _gpu_count() > 1 or _xpu_count() > 1, "test requires multiple GPUs or XPUs")(test_case)


def require_torch_min_version(test_case=None, version=None):
    """Run the test only with torch ``version`` or newer; usable as ``@require_torch_min_version(version="2.6")``."""
    if test_case is None:
        return lambda case: require_torch_min_version(case, version=version)
    return _requiring(lambda: availability.is_torch_version(">=", version), f"test requires torch >= {version}")(
        test_case
    )


def _package(probe: str, package: str):
    def decorator(test_case):
        return _requiring(lambda: getattr(availability, probe)(), f"test requires {package}")(test_case)

    decorator.__doc__ = f"Run the test only when {package} is installed."
    return decorator


require_peft = _package("is_peft_available", "peft")
require_datasets = _package("is_datasets_available", "datasets")
require_transformers = _package("is_transformers_available", "transformers")
require_timm = _package("is_timm_available", "timm")
require_torchvision = _package("is_torchvision_available", "torchvision")
require_triton = _package("is_triton_available", "triton")
require_schedulefree = _package("is_schedulefree_available", "schedulefree")
require_bnb = _package("is_bnb_available", "bitsandbytes")
require_deepspeed = _package("is_deepspeed_available", "deepspeed")
require_tensorboard = _package("is_tensorboard_available", "tensorboard")
require_wandb = _package("is_wandb_available", "wandb")
require_comet_ml = _package("is_comet_ml_available", "comet_ml")
require_aim = _package("is_aim_available", "aim")
require_clearml = _package("is_clearml_available", "clearml")
require_dvclive = _package("is_dvclive_available", "dvclive")
require_pandas = _package("is_pandas_available", "pandas")
require_mlflow = _package("is_mlflow_available", "mlflow")
require_import_timer = _package("is_import_timer_available", "import_timer")
require_torchao = _package("is_torchao_available", "torchao")
require_matplotlib = _package("is_matplotlib_available", "matplotlib")
require_torchdata_stateful_dataloader = _package("is_torchdata_stateful_dataloader_available", "torchdata >= 0.8")


def _installed_spec(package: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(package) is not None


def require_trackio(test_case):
    """Run the test only when trackio is installed."""
    return _requiring(lambda: _installed_spec("trackio"), "test requires trackio")(test_case)


def require_swanlab(test_case):
    """Run the test only when swanlab is installed."""
    return _requiring(lambda: _installed_spec("swanlab"), "test requires swanlab")(test_case)


def require_huggingface_suite(test_case):
    """Run the test only when transformers and datasets are installed."""
    installed = lambda: availability.is_transformers_available() and availability.is_datasets_available()  # noqa: E731
    return _requiring(installed, "test requires the Hugging Face suite (transformers, datasets)")(test_case)


def require_trackers(test_case):
    """Run the test only when at least one tracker package (tensorboard, wandb, comet_ml, aim, clearml, dvclive,
    mlflow) is installed."""
    probes = (
        "is_tensorboard_available",
        "is_wandb_available",
        "is_comet_ml_available",
        "is_aim_available",
        "is_clearml_available",
        "is_dvclive_available",
        "is_mlflow_available",
    )
    return _requiring(lambda: any(getattr(availability, p)() for p in probes), "test requires at least one tracker")(
        test_case
    )


def run_first(test_case):
    """Run this test before the others (with the ``pytest-order`` plugin; a no-op without pytest)."""
    if availability.is_pytest_available():
        import pytest

        return pytest.mark.order(1)(test_case)
    return test_case


class TempDirTestCase(unittest.TestCase):
    """A test case with one temporary folder for the class (``self.tmpdir``), emptied before each test when
    ``clear_on_setup`` and removed at the end."""

    clear_on_setup = True

    @classmethod
    def setUpClass(cls):
        cls.tmpdir = Path(tempfile.mkdtemp())

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmpdir, ignore_errors=True)

    def setUp(self):
        if self.clear_on_setup:
            for path in self.tmpdir.glob("**/*"):
                if path.is_file():
                    path.unlink()
                elif path.is_dir():
                    shutil.rmtree(path)


class AccelerateTestCase(unittest.TestCase):
    """A test case that resets hasten's process-wide state after each test, so tests cannot leak settings."""

    def tearDown(self):
        super().tearDown()
        from ..state import reset_state

        reset_state()


class MockingTestCase(unittest.TestCase):
    """A test case that starts ``unittest.mock`` patches with :meth:`add_mocks` and stops them after the test."""

    def add_mocks(self, mocks):
        """Start ``mocks`` (one patcher or a list) now; they stop when the test ends."""
        self.mocks = mocks if isinstance(mocks, (tuple, list)) else [mocks]
        for patcher in self.mocks:
            patcher.start()
            self.addCleanup(patcher.stop)


def are_the_same_tensors(tensor) -> bool:
    """Whether ``tensor`` is equal on every process (a collective)."""
    from ..runtime.operations import gather
    from ..state import PartialState

    state = PartialState()
    local = tensor[None].clone().to(state.device)
    everyone = gather(local).cpu()
    return all(torch.equal(everyone[i], tensor.cpu()) for i in range(everyone.shape[0]))


class _RunOutput:
    def __init__(self, returncode, stdout, stderr):
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr


def execute_subprocess_async(cmd: list, env=None, stdin=None, timeout=180, quiet=False, echo=True) -> _RunOutput:
    """Run ``cmd`` (printing its output unless ``quiet``); raise ``RuntimeError`` with its stderr when it fails.
    Returns an object with ``returncode`` and the ``stdout``/``stderr`` lines."""
    if echo:
        print("\nRunning: ", " ".join(map(str, cmd)))
    process = subprocess.run(
        [str(c) for c in cmd], input=stdin, env=env, capture_output=True, text=True, timeout=timeout
    )
    if not quiet:
        print(process.stdout, end="")
        print(process.stderr, end="", file=sys.stderr)
    result = _RunOutput(process.returncode, process.stdout.splitlines(), process.stderr.splitlines())
    if process.returncode != 0:
        raise RuntimeError(
            f"'{' '.join(map(str, cmd))}' failed with returncode {process.returncode}\n\n"
            f"The combined stderr from workers follows:\n{process.stderr}"
        )
    return result


def pytest_xdist_worker_id() -> int:
    """The index of this pytest-xdist worker (``gw3`` is 3), 0 without xdist."""
    worker = parse_choice_from_env("PYTEST_XDIST_WORKER", "gw0")
    return int(worker.removeprefix("gw") or 0)


def get_torch_dist_unique_port() -> int:
    """A rendezvous port per pytest-xdist worker (29500 + worker index), so parallel tests do not collide."""
    return 29500 + pytest_xdist_worker_id()


class SubprocessCallException(Exception):
    """A command run by :func:`run_command` failed; the message holds its output."""


def run_command(command: list[str], return_stdout=False, env=None):
    """Run ``command``; return its output when ``return_stdout``. A failure raises :class:`SubprocessCallException`
    with the command's output."""
    try:
        output = subprocess.check_output([str(c) for c in command], stderr=subprocess.STDOUT, env=env)
    except subprocess.CalledProcessError as error:
        raise SubprocessCallException(
            f"Command `{' '.join(map(str, command))}` failed with:\n{error.output.decode()}"
        ) from error
    return output.decode("utf-8") if return_stdout else None


def path_in_accelerate_package(*components: str) -> Path:
    """A path inside the installed hasten package (Accelerate's name: under an import alias this is the package
    that ``accelerate`` resolves to)."""
    return Path(__file__).resolve().parent.parent.joinpath(*components)


@contextlib.contextmanager
def assert_exception(exception_class: Exception, msg: str | None = None):
    """Assert that the block raises ``exception_class`` (with ``msg`` in its message, when given)."""
    try:
        yield
    except exception_class as error:
        if msg is not None and msg not in str(error):
            raise AssertionError(
                f"{exception_class.__name__} was raised, but its message lacks {msg!r}: {error}"
            ) from error
    except Exception as error:
        raise AssertionError(f"Expected {exception_class.__name__}, got {type(error).__name__}: {error}") from error
    else:
        raise AssertionError(f"Expected {exception_class.__name__} to be raised")


def capture_call_output(func, *args, **kwargs) -> str:
    """What ``func(*args, **kwargs)`` prints to stdout."""
    captured = io.StringIO()
    with contextlib.redirect_stdout(captured):
        func(*args, **kwargs)
    return captured.getvalue()
