"""transformers' ``Trainer`` with DeepSpeed runs on hasten as on Accelerate 1.15: the Trainer passes its own
``HfTrainerDeepSpeedConfig`` and later fills the config's "auto" values through it (``trainer_config_finalize``),
so the plugin must keep that object. hasten replaced it with a view of a copy, and the Trainer failed with
``'HfDeepSpeedConfig' object has no attribute 'trainer_config_finalize'``. Both sides run the same script
(tests/scripts/clients/trainer_deepspeed.py) on 2 processes; losses and final weights must be equal, bit for bit."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from differential import REFERENCE
from helpers import ROOT, SCRIPTS, clean_env, free_port, requires

SCRIPT = SCRIPTS / "clients" / "trainer_deepspeed.py"


def _launch(side: str, out) -> None:
    port = str(free_port())
    if side == "hasten":
        command = [sys.executable, "-m", "hasten.commands.main", "launch", "--as_accelerate", "--num_processes", "2"]
        command += ["--main_process_port", port, "-q"]
        env = clean_env(PYTHONPATH=str(ROOT / "src"))
    else:  # Accelerate's DeepSpeed path sets up gloo itself under torchrun (no ACCELERATE_USE_CPU)
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port]
        env = clean_env(PYTHONPATH=str(REFERENCE))
    proc = subprocess.run([*command, str(SCRIPT), str(out)], env=env, cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, f"{side} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


@pytest.mark.slow
@requires("reference", "transformers", "deepspeed")
def test_trainer_with_deepspeed_gives_accelerates_losses_and_weights(tmp_path):
    from safetensors.torch import load_file

    for side in ("accelerate", "hasten"):
        _launch(side, tmp_path / side)
    losses = {side: json.loads((tmp_path / side / "losses.json").read_text()) for side in ("accelerate", "hasten")}
    assert losses["hasten"] == losses["accelerate"] and len(losses["hasten"]) == 4, losses
    theirs = load_file(str(tmp_path / "accelerate" / "weights.safetensors"))
    ours = load_file(str(tmp_path / "hasten" / "weights.safetensors"))
    assert theirs.keys() == ours.keys()
    different = [key for key in theirs if not (theirs[key] == ours[key]).all()]
    assert not different, different
