"""Launch mistakes reported as one clear error before anything starts: a port outside 1-65535 (from a flag or the
config file), a folder given as the script."""

from __future__ import annotations

import pytest

from hasten.commands import launch as launch_cmd
from hasten.commands.main import build_parser, main
from hasten.config import Hardware
from hasten.errors import ConfigError

CPU = Hardware("cpu", 0)


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    """No default config file of the user's is read."""
    monkeypatch.setenv("HASTEN_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("HF_HOME", raising=False)


def _args(*argv: str):
    return build_parser(["launch"]).parse_args(["launch", *argv])


@pytest.fixture
def script(tmp_path) -> str:
    path = tmp_path / "train.py"
    path.write_text("")
    return str(path)


@pytest.mark.parametrize("port", ["99999", "-1", "65536"])
def test_a_port_outside_1_to_65535_is_a_clear_error(script, port):
    with pytest.raises(ConfigError, match=rf"main_process_port={port} \(from flag --main_process_port\) is not a TCP"):
        launch_cmd.prepare_launch(_args("--num_processes", "2", "--main_process_port", port, script), hardware=CPU)


def test_port_0_is_a_free_port_on_one_machine_as_in_accelerate(script):
    plan = launch_cmd.prepare_launch(_args("--num_processes", "2", "--main_process_port", "0", script), hardware=CPU)
    assert plan.settings.config.main_process_port is None  # the launcher's free port (it used 29500)
    assert "HASTEN_MAIN_PROCESS_PORT" not in plan.env
    argv = ["--num_machines", "2", "--num_processes", "2", "--main_process_ip", "10.0.0.1", "--machine_rank", "1"]
    with pytest.raises(ConfigError, match=r"main_process_port=0 \(from flag --main_process_port\) asks for a free"):
        launch_cmd.prepare_launch(_args(*argv, "--main_process_port", "0", script), hardware=CPU)


def test_a_port_of_the_config_file_names_the_file(tmp_path, script, capsys):
    config_file = tmp_path / "c.yaml"
    config_file.write_text("num_processes: 2\nmain_process_port: 70000\n")
    assert main(["launch", "--config_file", str(config_file), script]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"hasten launch: error: main_process_port=70000 (from config file {config_file}) is not a")
    assert "give a number from 1 to 65535" in err


def test_a_folder_is_not_a_script(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "logs").mkdir()
    with pytest.raises(ConfigError, match=r"Training script 'logs' is a folder, not a Python file\. Pass the script "):
        launch_cmd.prepare_launch(_args("logs"), hardware=CPU)
    (tmp_path / "logs" / "train.py").write_text("")
    with pytest.raises(ConfigError, match=r"Pass the script inside it such as logs/train\.py; a folder runs only"):
        launch_cmd.prepare_launch(_args("logs"), hardware=CPU)
    (tmp_path / "logs" / "__main__.py").write_text("")  # python runs such a folder, and so does launch
    assert launch_cmd.prepare_launch(_args("logs"), hardware=CPU).command[-1] == "logs"
