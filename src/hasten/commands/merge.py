"""Accelerate's ``accelerate.commands.merge`` path: ``merge_command`` and ``merge_command_parser`` of
``hasten merge-weights`` (the code lives in :mod:`hasten.commands.merge_weights`), and ``main``."""

import sys

from .merge_weights import merge_command, merge_command_parser

__all__ = ["main", "merge_command", "merge_command_parser"]


def main(argv: list[str] | None = None) -> int:
    """Run ``merge-weights`` with ``argv`` (default: this process's arguments): the ``accelerate-merge-weights``
    console script and ``python -m accelerate.commands.merge``."""
    from .main import run_subcommand

    return run_subcommand("merge-weights", argv)


if __name__ == "__main__":
    sys.exit(main())
