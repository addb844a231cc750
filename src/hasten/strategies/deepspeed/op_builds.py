"""The launcher's line about DeepSpeed's CPU ops that a job will compile before it trains.

DeepSpeed compiles an op the first time a process needs it (``deepspeed_shm_comm`` for the collectives of CPU
processes, ``cpu_adam`` for the Adam optimizer of an optimizer offloaded to the CPU or NVMe, ``fused_adam`` for the
Adam or AdamW that a config file's ``optimizer`` section names otherwise) into the torch extensions folder, and says
nothing while it does: a minute or two per op on a 2-core machine. ``make`` builds all three into the venv's folder,
which every process of that venv uses; elsewhere, or after that folder was removed, ``hasten launch``
says which ops the job compiles first, where, and about how long it takes. An op already built there counts as built
only when the ``ninja`` on ``PATH`` agrees: Debian's ninja and the wheel's record a build under different hashes,
so an op built by one is compiled again by the other (an activated venv and one that is not).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from ... import environment
from ...errors import HastenError
from .config import get_value, load_config

BUILD_TIME = "about 1-2 minutes per op on 2 free cores, more on busy ones"
"""How long DeepSpeed takes to compile one CPU op (cpu_adam and deepspeed_shm_comm measured on a 2-core machine)."""


def ops_to_build(settings) -> list[str]:
    """The CPU ops the launch ``settings`` need that the workers' torch extensions folder does not hold yet."""
    import torch

    config = settings.config
    needed = []
    if config.use_cpu or not torch.cuda.is_available():
        needed.append("deepspeed_shm_comm")
    section = config.deepspeed_config
    file = _config_file(section)
    if _offloaded_optimizer(section, file) in ("cpu", "nvme"):
        needed.append("cpu_adam")
    elif _fused_adam(file):
        needed.append("fused_adam")
    folder = environment.torch_extensions_dir()
    return [op for op in needed if not (folder / op / f"{op}.so").is_file() or _rebuilt(folder / op)]


def _rebuilt(build: Path) -> bool:
    """True when the ``ninja`` on ``PATH`` would compile the op built in ``build`` again (another ninja built it,
    or its sources changed)."""
    ninja = shutil.which("ninja")
    if ninja is None or not (build / "build.ninja").is_file():
        return False
    try:
        dry = subprocess.run([ninja, "-C", str(build), "-n"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return dry.returncode == 0 and "no work to do" not in dry.stdout


def _config_file(section) -> dict | None:
    """The DeepSpeed config file the launch names, read (None when there is none or it cannot be read: the
    processes report a broken file themselves)."""
    if not section.deepspeed_config_file or not Path(section.deepspeed_config_file).is_file():
        return None
    try:
        config, _ = load_config(section.deepspeed_config_file)
    except HastenError:
        return None
    return config


def _offloaded_optimizer(section, file: dict | None) -> str | None:
    """Where the optimizer state goes: the launch setting, else the DeepSpeed config file's (None when unknown)."""
    if section.offload_optimizer_device is not None:
        return section.offload_optimizer_device
    return None if file is None else get_value(file, "zero_optimization.offload_optimizer.device")


def _fused_adam(file: dict | None) -> bool:
    """Whether DeepSpeed builds its own Adam for the config file's ``optimizer`` section (Adam or AdamW, without
    ``torch_adam``), the ``fused_adam`` op."""
    if file is None:
        return False
    kind = str(get_value(file, "optimizer.type") or "").lower()
    return kind in ("adam", "adamw") and not get_value(file, "optimizer.params.torch_adam")


def build_note(settings) -> list[str]:
    """One line saying which ops the job compiles first, where, and about how long it takes (none when all are
    built)."""
    ops = ops_to_build(settings)
    if not ops:
        return []
    folder = environment.torch_extensions_dir()
    again = [op for op in ops if (folder / op / f"{op}.so").is_file()]
    return [
        f"DeepSpeed compiles its {' and '.join(ops)} op{'s' if len(ops) > 1 else ''} into {folder} before the first "
        f"step ({BUILD_TIME}); later runs reuse {'them' if len(ops) > 1 else 'it'}. `make` builds all three ahead, "
        "into the venv's folder."
        + (
            f" {shutil.which('ninja')} finds the build of {' and '.join(again)} there out of date: another ninja "
            "built it (each switch between two compiles again: activate the venv, docs/deepspeed.md) or its sources "
            "changed."
            if again
            else ""
        )
    ]
