"""``hasten launch`` says which of DeepSpeed's CPU ops a job compiles before it trains (DeepSpeed itself says nothing
for a minute or two per op), where, and about how long; nothing when they are built. The venv ``make`` builds makes
every process use its own extensions folder (``hasten-torch-extensions.pth``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, clean_env, requires

from hasten import environment
from hasten.commands import launch as launch_cmd
from hasten.config import Hardware

CPU = Hardware("cpu", 0)
CONFIG = str(ROOT / "examples" / "ds_config_zero2.json")  # its optimizer is offloaded to the CPU


@pytest.fixture
def script(tmp_path, monkeypatch) -> str:
    monkeypatch.setenv("HASTEN_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    path = tmp_path / "train.py"
    path.write_text("")
    return str(path)


def _warnings(*argv: str) -> list[str]:
    args = launch_cmd.launch_command_parser().parse_args(["--num_processes", "2", "--use_deepspeed", *argv])
    return launch_cmd.prepare_launch(args, hardware=CPU).warnings


@requires("deepspeed")
def test_the_ops_a_cpu_job_compiles_are_named_with_their_folder(script, tmp_path):
    (note,) = _warnings("--deepspeed_config_file", CONFIG, script)
    assert note == (
        f"DeepSpeed compiles its deepspeed_shm_comm and cpu_adam ops into {tmp_path / 'extensions'} before the first "
        "step (about 1-2 minutes per op on 2 free cores, more on busy ones); later runs reuse them. `make` builds "
        "all three ahead, into the venv's folder."
    )
    built = tmp_path / "extensions" / "deepspeed_shm_comm" / "deepspeed_shm_comm.so"
    built.parent.mkdir(parents=True)
    built.write_bytes(b"")
    (note,) = _warnings("--deepspeed_config_file", CONFIG, script)
    assert note.startswith("DeepSpeed compiles its cpu_adam op into ") and "reuse it." in note
    assert _warnings("--zero_stage", "2", script) == []  # no offload: only the collectives' op, built


@requires("deepspeed")
def test_an_adam_named_by_the_config_file_is_deepspeeds_fused_adam_op(script, tmp_path):
    built = tmp_path / "extensions" / "deepspeed_shm_comm" / "deepspeed_shm_comm.so"
    built.parent.mkdir(parents=True)
    built.write_bytes(b"")
    config = tmp_path / "ds.json"
    for optimizer, op in (({"type": "AdamW"}, ["fused_adam"]), ({"type": "Adam", "params": {"torch_adam": True}}, [])):
        config.write_text(json.dumps({"zero_optimization": {"stage": 2}, "optimizer": optimizer}))
        notes = _warnings("--deepspeed_config_file", str(config), script)
        assert [note.split(" op")[0].removeprefix("DeepSpeed compiles its ") for note in notes] == op, notes


def test_the_folder_is_torchs_own_default_without_the_variable(monkeypatch):
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    folder = environment.torch_extensions_dir()
    assert folder.parent == Path.home() / ".cache" / "torch_extensions" and folder.name.startswith("py3")


@requires("make venv")
def test_the_venv_of_make_points_every_process_at_its_folder():
    """The .pth file that `make` writes."""
    env = {k: v for k, v in clean_env().items() if k != "TORCH_EXTENSIONS_DIR"}
    code = "import os; print(os.environ['TORCH_EXTENSIONS_DIR'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == os.path.join(sys.prefix, "torch_extensions")
    env["TORCH_EXTENSIONS_DIR"] = "/elsewhere"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "/elsewhere"


@requires("deepspeed")
def test_an_op_built_by_another_ninja_is_named_as_compiled_again(script, tmp_path):
    # What ninja says when its log holds another version's hash for the command: the output is out of date.
    build = tmp_path / "extensions" / "deepspeed_shm_comm"
    build.mkdir(parents=True)
    (build / "deepspeed_shm_comm.so").write_bytes(b"")
    (build / "build.ninja").write_text(
        "rule link\n  command = touch $out\nbuild deepspeed_shm_comm.so: link shm.o\nbuild shm.o: link\n"
    )
    (note,) = _warnings("--zero_stage", "2", script)
    assert note.startswith("DeepSpeed compiles its deepspeed_shm_comm op into ")
    assert "finds the build of deepspeed_shm_comm there out of date: another ninja built it" in note, note
    subprocess.run(["ninja", "-C", str(build)], check=True, capture_output=True)
    assert _warnings("--zero_stage", "2", script) == []  # ninja agrees: nothing to say
