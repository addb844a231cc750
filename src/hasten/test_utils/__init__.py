"""Helpers for testing distributed code with hasten, and the scripts that ``hasten test`` runs."""

from __future__ import annotations

import sys
from pathlib import Path

SCRIPTS_DIR = Path(__file__).parent / "scripts"


def self_check_script_path() -> Path:
    """Path of the bundled distributed self-check (``hasten test`` launches it)."""
    return SCRIPTS_DIR / "test_script.py"


def get_launch_command(**kwargs) -> list[str]:
    """``hasten launch`` as an argument list, with ``key=value`` turned into ``--key value``.

    ``True`` gives a bare switch (``--debug``); ``False`` and ``None`` are left out.

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
