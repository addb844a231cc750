"""Accelerate's own distributed check scripts (``accelerate/test_utils/scripts/`` of the reference copy
of accelerate 1.15.0, which `make reference` installs beside the venv) run unchanged on hasten: 2
processes under torchrun, ``import accelerate`` answered by hasten through the alias shim.

They are Accelerate's behavioural contract for collectives, training equality with one process,
gradient accumulation and synchronisation, dataloader sharding and uneven inputs; hasten passing them
as they are is what "change the imports and it runs" means.
"""

from __future__ import annotations

import os
import shutil

import pytest
from helpers import ROOT, clean_env, requires, torchrun

from hasten.accelerate_alias import SHIM_DIR

SCRIPTS_DIR = ROOT / ".reference" / "accelerate-1.15.0" / "accelerate" / "test_utils" / "scripts"
# The shim answers `import accelerate`; this repository's src answers `import hasten` (not the venv's install).
SCRIPT_PATH = os.pathsep.join([str(SHIM_DIR), str(ROOT / "src")])


@pytest.mark.slow
@requires("reference")
@pytest.mark.parametrize("script", ["test_ops.py", "test_script.py", "test_sync.py"])
def test_accelerates_own_check_script_passes_on_two_processes(script, tmp_path):
    source = SCRIPTS_DIR / script
    copy = tmp_path / script  # run from outside the reference package: only the shim answers `import accelerate`
    shutil.copy(source, copy)
    env = clean_env(PYTHONPATH=SCRIPT_PATH)
    proc = torchrun(copy, env=env, timeout=600)
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]


@pytest.mark.slow
@requires("reference")
def test_accelerates_data_loop_script_passes_with_a_save_folder_per_process(tmp_path):
    # The script saves with `tempfile.TemporaryDirectory()` on each process, i.e. into a different folder per
    # process: each process writes a complete checkpoint of its own there (this used to leave process 1
    # waiting for a folder nobody wrote).
    source = SCRIPTS_DIR / "test_distributed_data_loop.py"
    copy = tmp_path / source.name
    shutil.copy(source, copy)
    env = clean_env(PYTHONPATH=SCRIPT_PATH)
    proc = torchrun(copy, env=env, timeout=600)
    assert "Traceback" not in proc.stderr and "Test DataLoader with sampler as an instance" in proc.stdout, proc.stderr[
        -4000:
    ]
