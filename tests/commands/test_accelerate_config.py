"""Under Accelerate's name (the ``accelerate`` command, ``python -m accelerate.commands.<x>``, ``hasten launch
--as_accelerate``) the commands read and write Accelerate's config file, found where Accelerate 1.15 finds it, and
their messages name the command the user typed; ``hasten launch`` keeps its own file.

The end-to-end test starts from a fresh HOME holding only a config file written by the reference copy of Accelerate
(its ``accelerate config default``, then its own config class set to 2 CPU processes, as ``accelerate config``
would answer on this machine)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from differential import REFERENCE
from helpers import ROOT, clean_env, requires

from hasten import environment
from hasten.commands import config_location
from hasten.commands import launch as launch_cmd
from hasten.commands.config_location import file_to_read, file_to_write
from hasten.config import Hardware

ACCELERATE = Path(sys.executable).with_name("accelerate")
CPU = Hardware("cpu", 0)
RANKS_SCRIPT = "import os\nprint('rank', os.environ.get('RANK'), 'of', os.environ.get('WORLD_SIZE'), flush=True)\n"


@pytest.fixture
def home(monkeypatch, tmp_path):
    """A fresh HOME, no HF_HOME, XDG_CACHE_HOME or HASTEN_HOME: every default file lives under it."""
    for name in ("HF_HOME", "XDG_CACHE_HOME", "HASTEN_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


def _write(path: Path, text: str = "distributed_type: MULTI_CPU\nnum_processes: 2\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_accelerate_finds_its_file_where_accelerate_does(home, monkeypatch):
    theirs = home / ".cache" / "huggingface" / "accelerate" / "default_config.yaml"
    assert file_to_read(None, accelerate=True).path is None
    _write(theirs)
    assert file_to_read(None, accelerate=True).path == theirs
    assert file_to_read(None, accelerate=True).source == "Accelerate's default file"
    monkeypatch.setenv("XDG_CACHE_HOME", str(home / "xdg"))
    assert file_to_read(None, accelerate=True).path is None
    xdg = _write(home / "xdg" / "huggingface" / "accelerate" / "default_config.yaml")
    assert file_to_read(None, accelerate=True).path == xdg
    monkeypatch.setenv("HF_HOME", str(home / "hf"))  # HF_HOME wins over XDG_CACHE_HOME, as in Accelerate
    hf = _write(home / "hf" / "accelerate" / "default_config.yaml")
    assert file_to_read(None, accelerate=True).path == hf
    assert file_to_write(None, accelerate=True) == hf
    # hasten launch keeps its own file, and says where Accelerate's is
    hasten_side = file_to_read(None, accelerate=False)
    assert hasten_side.path is None and hasten_side.source == f"found Accelerate's {hf}"
    assert file_to_write(None, accelerate=False) == home / "hf" / "hasten" / "default_config.yaml"


def test_named_files_come_first_and_cpu_reads_no_default_file(home, monkeypatch):
    theirs = _write(home / ".cache" / "huggingface" / "accelerate" / "default_config.yaml")
    own = _write(home / ".cache" / "huggingface" / "hasten" / "default_config.yaml")
    assert file_to_read(None, accelerate=False).path == own
    monkeypatch.setenv("ACCELERATE_CONFIG_FILE", str(home / "a.yaml"))
    assert file_to_read(None, accelerate=True).path == home / "a.yaml"
    assert file_to_read(None, accelerate=False).source == "ACCELERATE_CONFIG_FILE"
    monkeypatch.setenv("HASTEN_CONFIG_FILE", str(home / "h.yaml"))
    assert file_to_read(None, accelerate=True).path == home / "h.yaml"
    assert file_to_read(str(home / "flag.yaml"), accelerate=True, cpu=True).path == home / "flag.yaml"
    monkeypatch.delenv("ACCELERATE_CONFIG_FILE")
    monkeypatch.delenv("HASTEN_CONFIG_FILE")
    # Accelerate reads no default file with --cpu
    cpu = file_to_read(None, accelerate=True, cpu=True)
    assert cpu.path is None and cpu.hint == f"pass --config_file {theirs} to use it"
    assert file_to_read(None, accelerate=False, cpu=True).path == own  # hasten launch --cpu reads its own
    theirs.unlink()
    fallback = file_to_read(None, accelerate=True)
    assert fallback.path == own and fallback.source.startswith("hasten's default file; Accelerate has none at ")


def test_as_accelerate_launch_reads_accelerates_file(home, tmp_path):
    theirs = _write(home / ".cache" / "huggingface" / "accelerate" / "default_config.yaml")
    script = tmp_path / "train.py"
    script.write_text(RANKS_SCRIPT)
    parse = launch_cmd.launch_command_parser().parse_args
    plan = launch_cmd.prepare_launch(parse(["--as_accelerate", str(script)]), hardware=CPU)
    assert plan.settings.config.num_processes == 2 and plan.loaded.path == theirs
    assert f"  config file : {theirs} (Accelerate's default file)" in launch_cmd.format_summary(plan)
    plan = launch_cmd.prepare_launch(parse([str(script)]), hardware=CPU)
    assert plan.settings.config.num_processes == 1 and plan.loaded is None


@requires("reference")
def test_the_reference_finds_its_file_where_hasten_looks_for_it(tmp_path):
    """Accelerate's own lookup (its module-level default_config_file), with HF_HOME, XDG_CACHE_HOME or neither."""
    code = (
        "from accelerate.commands.config.config_args import default_config_file\n"
        "from hasten import environment\n"
        "print(default_config_file)\n"
        "print(environment.accelerate_config_home() / 'default_config.yaml')\n"
    )
    for extra in ({}, {"XDG_CACHE_HOME": str(tmp_path / "xdg")}, {"HF_HOME": str(tmp_path / "hf")}):
        env = {k: v for k, v in clean_env(HOME=str(tmp_path)).items() if k not in ("HF_HOME", "XDG_CACHE_HOME")}
        env.update(extra, PYTHONPATH=os.pathsep.join([str(REFERENCE), str(ROOT / "src")]))
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
        theirs, ours = out.split()
        assert theirs == ours, extra


def _accelerate_env(home: Path) -> dict[str, str]:
    env = clean_env(HOME=str(home))
    for name in ("HF_HOME", "XDG_CACHE_HOME", "HASTEN_HOME", "PYTHONPATH"):
        env.pop(name, None)
    return env


def _reference_config(home: Path) -> Path:
    """Accelerate 1.15's `accelerate config default`, then the file set to 2 CPU processes by its own config class."""
    env = {**_accelerate_env(home), "PYTHONPATH": str(REFERENCE)}
    subprocess.run(
        [sys.executable, "-m", "accelerate.commands.accelerate_cli", "config", "default"], env=env, check=True
    )
    code = (
        "from accelerate.commands.config.config_args import default_config_file, load_config_from_file\n"
        "config = load_config_from_file(None)\n"
        "config.distributed_type, config.num_processes = 'MULTI_CPU', 2\n"
        "config.to_json_file(default_config_file)\n"
        "print(default_config_file)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    return Path(out.strip())


@pytest.mark.slow
@requires("reference", "accelerate command")
def test_accelerate_launch_honours_a_config_written_by_accelerate(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    written = _reference_config(home)
    assert written == home / ".cache" / "huggingface" / "accelerate" / "default_config.yaml"
    (tmp_path / "train.py").write_text(RANKS_SCRIPT)
    env = _accelerate_env(home)
    routes = [
        ("accelerate launch", [str(ACCELERATE), "launch", "train.py"]),
        ("accelerate launch", [sys.executable, "-m", "accelerate.commands.launch", "train.py"]),
        ("hasten launch", [sys.executable, "-m", "hasten.commands.main", "launch", "--as_accelerate", "train.py"]),
    ]
    for prefix, command in routes:
        proc = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, (command, proc.stdout, proc.stderr)
        assert sorted(proc.stdout.split("\n"))[-2:] == ["rank 0 of 2", "rank 1 of 2"], (command, proc.stdout)
        assert proc.stderr.startswith(f"{prefix}: 2 process(es) on 1 machine (2 here), MULTI_CPU"), proc.stderr
        assert f"  config file : {written} (Accelerate's default file)" in proc.stderr, proc.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "hasten.commands.main", "launch", "train.py"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and proc.stdout == "rank None of None\n", proc.stdout  # one process, not launched
    assert f"config file : none (found Accelerate's {written}: `hasten config update` imports it" in proc.stderr


@requires("accelerate command")
def test_messages_name_the_accelerate_command(tmp_path):
    env = _accelerate_env(tmp_path)
    missing = tmp_path / "missing.yaml"
    proc = subprocess.run(
        [str(ACCELERATE), "launch", "--config_file", str(missing), "train.py"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 1
    assert proc.stderr.startswith(f"accelerate launch: error: Launch config file {missing} does not exist"), proc.stderr
    assert "`accelerate config` (interactive) or `accelerate config default`" in proc.stderr
    proc = subprocess.run(
        [str(ACCELERATE), "config"], env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL
    )
    assert "needs an interactive terminal; use `accelerate config default` in scripts" in proc.stderr
    proc = subprocess.run([str(ACCELERATE), "config", "default"], env=env, capture_output=True, text=True)
    written = tmp_path / ".cache" / "huggingface" / "accelerate" / "default_config.yaml"
    assert proc.stdout == f"accelerate configuration saved at {written}\n" and written.is_file()


def test_config_location_names_no_command_of_its_own(monkeypatch, home):
    """The hints follow the command the user typed: ``hasten launch --as_accelerate`` suggests ``hasten config``."""
    monkeypatch.setattr(config_location, "command_name", lambda: "hasten")
    assert file_to_read(None, accelerate=True).hint == "run `hasten config` to create one"
    monkeypatch.setattr(config_location, "command_name", lambda: "accelerate")
    assert file_to_read(None, accelerate=True).hint == "run `accelerate config` to create one"
    assert environment.accelerate_config_home() == home / ".cache" / "huggingface" / "accelerate"
