"""Accelerate's ``accelerate.commands.accelerate_cli`` path: ``main`` runs the whole command line under the name
``accelerate``. The ``accelerate`` console script of hasten's ``accelerate`` distribution points here, as
Accelerate's own does."""

import sys

from .main import main as _main

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Run ``accelerate <command> [<args>]`` (hasten's commands, Accelerate's flags) with ``argv`` (default: this
    process's arguments); returns the exit code."""
    return _main(argv, prog="accelerate")


if __name__ == "__main__":
    sys.exit(main())
