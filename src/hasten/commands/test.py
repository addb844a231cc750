"""``hasten test``: run the bundled distributed self-check through ``hasten launch`` with the current config."""

from __future__ import annotations

import argparse
import sys

from ..test_utils import self_check_script_path


def add_parser(subparsers, help_text: str) -> argparse.ArgumentParser:
    """Register ``hasten test``."""
    parser = subparsers.add_parser(
        "test",
        help=help_text,
        description="Run the bundled distributed self-check through `hasten launch` with the current config.",
    )
    parser.add_argument(
        "--config_file", "--config-file", default=None, help="Config file to test (default: the default config file)."
    )
    parser.set_defaults(func=self_check_command)
    return parser


def self_check_command(args: argparse.Namespace) -> int:
    """Launch the self-check script; returns its exit code."""
    from .main import build_parser, program_name

    prog = program_name()
    argv = (
        ["launch"] + (["--config_file", args.config_file] if args.config_file else []) + [str(self_check_script_path())]
    )
    launch_args = build_parser(argv, prog).parse_args(argv)
    print(f"Running: {prog} {' '.join(argv)}", flush=True)
    code = launch_args.func(launch_args)
    if code != 0:
        print(
            f"{prog} test: the self-check failed (exit code {code}); the failing check is named above.", file=sys.stderr
        )
    return code


def main(argv: list[str] | None = None) -> int:
    """Run ``test`` with ``argv`` (default: this process's arguments): ``python -m hasten.commands.test``
    and ``python -m accelerate.commands.test``."""
    from .main import run_subcommand

    return run_subcommand("test", argv)


if __name__ == "__main__":
    sys.exit(main())
