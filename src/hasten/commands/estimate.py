"""Accelerate's ``accelerate.commands.estimate`` path: ``estimate_command`` and ``estimate_command_parser`` of
``hasten estimate-memory`` (the code lives in :mod:`hasten.commands.estimate_memory`), and ``main``."""

import sys

from .estimate_memory import estimate_command, estimate_command_parser

__all__ = ["estimate_command", "estimate_command_parser", "main"]


def main(argv: list[str] | None = None) -> int:
    """Run ``estimate-memory`` with ``argv`` (default: this process's arguments): the ``accelerate-estimate-memory``
    console script and ``python -m accelerate.commands.estimate``."""
    from .main import run_subcommand

    return run_subcommand("estimate-memory", argv)


if __name__ == "__main__":
    sys.exit(main())
