"""Entry point of the ``hasten`` command: ``hasten <command> [<args>]``.

Each subcommand lives in its own module with an ``add_parser(subparsers, help_text)`` function; none of them
imports torch at module level, so ``hasten --help`` answers at once. The same command line answers as
``accelerate`` (the console scripts of hasten's ``accelerate`` distribution, ``python -m accelerate.commands.<x>``):
it then names itself ``accelerate`` in its usage and messages (:func:`program_name`).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from ..errors import did_you_mean
from ..settings.command import command_name

# command name -> (module that registers it, one-line help)
COMMANDS = {
    "config": ("hasten.commands.config", "Write the launch config file (interactive)."),
    "env": ("hasten.commands.env", "Print the environment, for bug reports."),
    "estimate-memory": (
        "hasten.commands.estimate_memory",
        "Estimate the memory a model needs to train (DeepSpeed ZeRO table).",
    ),
    "launch": ("hasten.commands.launch", "Launch a training script."),
    "merge-weights": ("hasten.commands.merge_weights", "Merge a DeepSpeed or FSDP sharded checkpoint into one model."),
    "test": ("hasten.commands.test", "Check that distributed training works here."),
}


class HastenParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose subcommands can replace argparse's "arguments are required" line with
    their own explanation (``missing_arguments_help``), and that names close options for a mistyped one."""

    def __init__(self, *args, missing_arguments_help: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.missing_arguments_help = missing_arguments_help

    def error(self, message: str):
        """Print the usage and ``message`` (or the subcommand's own help for missing arguments), exit 2."""
        if self.missing_arguments_help and message.startswith("the following arguments are required"):
            message = self.missing_arguments_help
        super().error(message)

    def reject_unknown(self, extras: list[str]) -> None:
        """Fail on arguments no option takes, with a did-you-mean for each mistyped ``--option``."""
        known = [name for name in self._option_string_actions if name.startswith("--")]
        options = [extra.split("=", 1)[0] for extra in extras if extra.startswith("--")]
        if not options:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        hints = [f"unknown option {name}.{did_you_mean(name, known)}" for name in options]
        self.error(f"{' '.join(hints)} `{self.prog} --help` lists the options.")


def program_name() -> str:
    """``"accelerate"`` when this process was started as Accelerate's command (the ``accelerate`` console scripts,
    ``python -m accelerate.commands.<x>``), else ``"hasten"``: the name the command line gives itself
    (:func:`hasten.settings.command.command_name`)."""
    return command_name()


def build_parser(argv: list[str] | None = None, prog: str = "hasten") -> argparse.ArgumentParser:
    """The ``hasten`` parser (named ``prog``). Only the subcommand named in ``argv`` is imported and fully built;
    the others are listed by name (all of them are built when ``argv`` is None)."""
    parser = HastenParser(
        prog=prog,
        description="Run one PyTorch training script on CPU, one or many GPUs, or many machines.",
        allow_abbrev=False,
    )
    subparsers = parser.add_subparsers(title="commands", dest="command", metavar="<command>", parser_class=HastenParser)
    wanted = next((arg for arg in argv if not arg.startswith("-")), None) if argv is not None else None
    for name, (module, help_text) in COMMANDS.items():
        if argv is None or name == wanted:
            importlib.import_module(module).add_parser(subparsers, help_text)
        else:
            subparsers.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Run the ``hasten`` command line (named ``prog``, by default :func:`program_name`); returns the exit code."""
    from ..errors import HastenError

    argv = sys.argv[1:] if argv is None else list(argv)
    prog = prog or program_name()
    parser = build_parser(argv, prog)
    args, extras = parser.parse_known_args(argv)
    if extras:
        subparsers = parser._subparsers._group_actions[0].choices if parser._subparsers else {}
        subparsers.get(args.command, parser).reject_unknown(extras)
    if args.command is None:
        parser.print_help()
        return 1
    try:
        return int(args.func(args) or 0)
    except HastenError as exc:
        print(f"{prog} {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog} {args.command}: interrupted.", file=sys.stderr)
        return 130


def run_subcommand(command: str, argv: list[str] | None = None) -> int:
    """Run one subcommand with ``argv`` (default: this process's arguments): the ``main`` of each command module,
    behind ``python -m hasten.commands.<x>``, ``python -m accelerate.commands.<x>`` and ``accelerate-launch``."""
    return main([command, *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
