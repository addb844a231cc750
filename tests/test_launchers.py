"""notebook_launcher and debug_launcher: real 2-process runs on CPU, and the refusals that protect them."""

from __future__ import annotations

import functools
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import free_port

from hasten import launchers
from hasten.errors import ConfigError, HastenError
from hasten.state import PartialState

SCRIPTS = Path(__file__).parent / "scripts"


def _fails_on_rank_one(message):
    if os.environ["RANK"] == "1":
        raise RuntimeError(message)


def _record(path, value):
    Path(path).write_text(json.dumps({"value": value, "precision": os.environ.get("HASTEN_MIXED_PRECISION")}))


@pytest.mark.slow
def test_both_launchers_run_two_processes_from_a_plain_python_process(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HASTEN_", "ACCELERATE_"))}
    command = [sys.executable, str(SCRIPTS / "cli_notebook_launch.py"), str(tmp_path), str(free_port())]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    for tag, precision, use_cpu in (("notebook", "bf16", None), ("debug", "no", "1")):
        for rank in (0, 1):
            seen = json.loads((tmp_path / f"{tag}_rank{rank}.json").read_text())
            expected = {
                "rank": rank,
                "world": 2,
                "type": "MULTI_CPU",
                "sum": 3.0,
                "precision": precision,
                "use_cpu": use_cpu,
                "fork": "1",
            }
            assert seen == expected


def _lambda_schedule(path, factor):
    from hasten import Accelerator

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=lambda n: 1 - n / factor)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    optimizer.step()
    scheduler.step()
    Path(f"{path}.{accelerator.process_index}").write_text(json.dumps(scheduler.get_last_lr()))


@pytest.mark.slow
def test_debug_launcher_runs_a_functools_partial_with_a_lambda_scheduler(tmp_path):
    # Accelerate's scheduler tests launch functools.partial objects; torch elastic reads the entrypoint's __name__.
    launchers.debug_launcher(functools.partial(_lambda_schedule, str(tmp_path / "lr"), factor=10), num_processes=2)
    for rank in (0, 1):  # one real optimizer step advances the schedule once per process
        assert json.loads((tmp_path / f"lr.{rank}").read_text()) == [0.8]


@pytest.mark.slow
def test_failures_name_the_process_and_carry_its_traceback():
    with pytest.raises(
        HastenError,
        match=(
            r"(?s)Process 1 of 2 failed \(exit code 1\) while running _fails_on_rank_one:\nTraceback .*RuntimeError: "
            r"boom on rank one"
        ),
    ):
        launchers.debug_launcher(_fails_on_rank_one, ("boom on rank one",))


def test_one_process_runs_here_with_the_precision(tmp_path):
    launchers.notebook_launcher(_record, (tmp_path / "r.json", 5), num_processes=1, mixed_precision="fp16")
    assert json.loads((tmp_path / "r.json").read_text()) == {"value": 5, "precision": "fp16"}
    assert "HASTEN_MIXED_PRECISION" not in os.environ


def test_refuses_when_cuda_is_initialised(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(ConfigError, match=r"CUDA was initialised in this process before the launcher could fork it"):
        launchers.notebook_launcher(_record, ("x", 1), num_processes=2, use_port=str(free_port()))
    with pytest.raises(ConfigError, match=r"CUDA was initialised"):
        launchers.debug_launcher(_record, ("x", 1))


def test_refuses_unpicklable_functions_with_spawn():
    with pytest.raises(
        ConfigError,
        match=r"start_method='spawn' sends \S*<lambda> and its args to new processes by pickling, and that failed",
    ):
        launchers.notebook_launcher(lambda: None, num_processes=2, use_port=str(free_port()), start_method="spawn")

    def nested():
        return None

    with pytest.raises(ConfigError, match=r"Define the function at the top level of an importable module"):
        launchers.notebook_launcher(nested, num_processes=2, use_port=str(free_port()), start_method="spawn")


def test_refuses_functions_of_an_interactive_session_with_spawn(monkeypatch):
    main_module = sys.modules["__main__"]

    def cell_function():
        return None

    cell_function.__module__, cell_function.__qualname__ = "__main__", "cell_function"
    monkeypatch.setattr(main_module, "cell_function", cell_function, raising=False)
    monkeypatch.delattr(main_module, "__file__", raising=False)
    with pytest.raises(ConfigError, match=r"start_method='spawn': cell_function is defined in an interactive session"):
        launchers.notebook_launcher(cell_function, num_processes=2, use_port=str(free_port()), start_method="spawn")


def test_refuses_an_existing_state_bad_settings_and_a_busy_port(monkeypatch):
    with pytest.raises(
        ConfigError, match=r"notebook_launcher\(mixed_precision='fp32'\): choose one of no, fp16, bf16, fp8"
    ):
        launchers.notebook_launcher(_record, num_processes=2, mixed_precision="fp32")
    with pytest.raises(ConfigError, match=r"debug_launcher needs num_processes >= 1, got 0"):
        launchers.debug_launcher(_record, num_processes=0)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(
            ConfigError, match=rf"Port {port} on 127\.0\.0\.1 is already in use .*use_port=\.\.\.\) \(got '{port}'\)"
        ):
            launchers.notebook_launcher(_record, num_processes=2, use_port=str(port))
    monkeypatch.setenv("HASTEN_USE_CPU", "1")
    PartialState()
    with pytest.raises(ConfigError, match=r"An Accelerator \(or PartialState\) already exists in this process"):
        launchers.debug_launcher(_record, ("x", 1))
