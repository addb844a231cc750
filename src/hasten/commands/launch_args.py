"""The flags of ``hasten launch``, built from the settings tables (grouped as Accelerate's ``-h`` groups them),
and which config setting each flag fills.

The options are the launch table's rows (:mod:`hasten.settings.launch`, in its order), each registered engine's
``--use_<engine>`` switch (:mod:`hasten.settings.engines`) and the rows of every config section
(``dynamo_config``, the engines' sections, ``fp8_config``, ``mpirun_config``). Within a ``-h`` group the engines'
switches come first, then the launch table's options, then the sections' ones; a section with a group of its own
comes after the launch table's groups, in the order of :data:`hasten.config.SECTIONS`.

Every flag accepts the ``_`` and the ``-`` spelling (``-h`` shows the first). A flag left off the command line
holds the value Accelerate's launch parser gives it (a row's ``flag_default``: ``False`` for a switch that chooses
the distributed type or an engine, ``"true"`` for ``--fsdp_sync_module_states``); what was given is recorded in
the namespace's ``nondefault`` set, as Accelerate records it, so that only given flags override the config file.
Flags that fill a config setting are parsed as text (numbers as numbers) and checked by
:func:`hasten.config.resolve_settings`, so a bad value gets the same message whether it came from a flag, the
config file or the environment.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from .. import environment
from ..config import SECTIONS, leaf_fields
from ..settings import Section, Setting
from ..settings.launch import DISTRIBUTED_TYPE, LAUNCH, PARADIGM

_BOOL = "{true,false}"
_TYPES = {"int": int, "float": float}
GIVEN = "nondefault"


@dataclass(frozen=True, slots=True)
class Flag:
    """One ``hasten launch`` option.

    ``path`` is the dotted config setting it fills (None for launch-only options); a ``switch`` takes
    no value and stores True; a switch that ``chooses`` fills ``distributed_type`` with that value. ``default``
    is the value when the flag is left off, ``type`` parses its text (None: kept as text).
    """

    name: str
    group: str
    help: str
    path: str | None = None
    switch: bool = False
    chooses: str | None = None
    short: str | None = None
    type: object = None
    metavar: str | None = None
    lower: bool = False
    default: object = None


def _row_flag(table: Section, row: Setting) -> Flag:
    """The option of a table's row: it fills the row's key (``distributed_type`` for a switch that chooses one), or,
    without key, is an option of the launch alone (typed by its kind)."""
    name, group, text = row.flag_name, row.group or table.group, row.flag_help
    if row.chooses is not None:
        return Flag(name, group, text, DISTRIBUTED_TYPE.key, True, row.chooses, row.short, default=False)
    kind = row.flag_type or _TYPES.get(row.kind)
    if not row.key:
        return Flag(name, group, text, None, row.switch, None, row.short, kind, row.metavar, default=row.flag_default)
    metavar = row.metavar or (_BOOL if row.kind == "bool" and not row.switch else None)
    path = table.path(row)
    return Flag(name, group, text, path, row.switch, None, row.short, kind, metavar, row.lower, row.flag_default)


def _flags() -> tuple[Flag, ...]:
    """Every option, by ``-h`` group (the launch table's groups, then the sections' own ones); within a group the
    engines' switches first, then the launch table's options, then the sections'."""
    chooses = DISTRIBUTED_TYPE.key
    switches = [
        Flag(engine.flag, PARADIGM, engine.flag_help, chooses, True, engine.distributed_type, default=False)
        for engine in environment.ENGINES
        if engine.flag
    ]
    launch = [_row_flag(LAUNCH, row) for row in LAUNCH.rows if row.flag_name]
    sections = [_row_flag(table, row) for table in SECTIONS for row in table.rows if row.flag_name]
    groups = dict.fromkeys([flag.group for flag in launch] + [table.group for table in SECTIONS])
    return tuple(flag for group in groups for flag in (*switches, *launch, *sections) if flag.group == group)


FLAGS: tuple[Flag, ...] = _flags()
_CHOOSERS = tuple(flag.name for flag in FLAGS if flag.path == DISTRIBUTED_TYPE.key)


def _metavar(flag: Flag) -> str | None:
    if flag.metavar or flag.path is None:
        return flag.metavar
    choices = leaf_fields()[flag.path].get("choices")
    return "{" + ",".join(str(c).lower() if flag.lower else str(c) for c in choices) + "}" if choices else None


class _Given(argparse.Action):
    """Store the flag's value (True for a switch) and record the flag as given in ``namespace.nondefault``."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)
        given = getattr(namespace, GIVEN, None)
        if given is None:
            given = set()
            setattr(namespace, GIVEN, given)
        given.add(self.dest)


class HelpFormatter(argparse.HelpFormatter):
    """``-h`` lists each option under its first spelling only (``--num_processes``, not ``--num-processes``)."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if not action.option_strings:
            return super()._format_action_invocation(action)
        shown = [name for name in action.option_strings if "-" not in name[2:]]
        copy = argparse.Action(shown, action.dest, action.nargs, metavar=action.metavar, choices=action.choices)
        return super()._format_action_invocation(copy)


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every launch flag (grouped) and the script positionals to ``parser``."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for flag in FLAGS:
        group = groups.get(flag.group) or groups.setdefault(flag.group, parser.add_argument_group(flag.group))
        names = [f"--{flag.name}"]
        if "_" in flag.name:
            names.append(f"--{flag.name.replace('_', '-')}")
        if flag.short:
            names.insert(0, flag.short)
        options = {"nargs": 0, "const": True} if flag.switch else {"type": flag.type, "metavar": _metavar(flag)}
        group.add_argument(*names, dest=flag.name, action=_Given, default=flag.default, help=flag.help, **options)
    parser.add_argument(
        "training_script", help="The script (or module, with -m) to run in every process, followed by its arguments."
    )
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)


def given_flags(args: argparse.Namespace) -> set[str]:
    """The launch flags ``args`` holds as given: those recorded in ``args.nondefault`` by the parser, and any other
    set to a value other than its default (a namespace built by hand, or changed after parsing; a switch set to
    False counts as left off)."""
    given = set(getattr(args, GIVEN, None) or ())
    for flag in FLAGS:
        left_off = _left_off(flag)
        value = getattr(args, flag.name, left_off)
        if value is not None and value != left_off and not (flag.switch and value is False):
            given.add(flag.name)
    return given


def _left_off(flag: Flag) -> object:
    """The flag's value when left off: its default, parsed by its type when the default is text (as argparse does)."""
    return flag.type(flag.default) if flag.type is not None and isinstance(flag.default, str) else flag.default


def flag_settings(args: argparse.Namespace) -> dict[str, tuple[object, str]]:
    """Config settings given on the command line: dotted path -> (raw value, ``--flag``)."""
    named = given_flags(args)
    given = [name for name in _CHOOSERS if name in named]
    if len(given) > 1 or (given and given[0] == "multi_gpu" and args.cpu):
        from ..errors import ConfigError

        chosen = given + (["cpu"] if args.cpu else [])
        names = "/".join(f"--{name}" for name in ("cpu", *_CHOOSERS))
        raise ConfigError(f"Pass at most one of {names}; got {', '.join('--' + n for n in chosen)}.")
    settings: dict[str, tuple[object, str]] = {}
    for flag in FLAGS:
        if flag.path is not None and flag.name in named:
            value = flag.chooses if flag.chooses is not None else getattr(args, flag.name)
            settings[flag.path] = (value, f"--{flag.name}")
    return settings
