"""The flags of ``hasten launch``, built from the settings tables (grouped as Accelerate's ``-h`` groups them),
and which config setting each flag fills.

The options are the launch table's rows (:mod:`hasten.settings.launch`, in its order), each registered engine's
``--use_<engine>`` switch (:mod:`hasten.settings.engines`) and the rows of every config section
(``dynamo_config``, the engines' sections, ``fp8_config``, ``mpirun_config``). Within a ``-h`` group the engines'
switches come first, then the launch table's options, then the sections' ones; a section with a group of its own
comes after the launch table's groups, in the order of :data:`hasten.config.SECTIONS`.

Every flag accepts the ``_`` and the ``-`` spelling. Flags that fill a config setting are parsed as
plain strings and checked by :func:`hasten.config.resolve_settings`, so a bad value gets the same
message whether it came from a flag, the config file or the environment.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from .. import environment
from ..config import SECTIONS, leaf_fields
from ..settings import Section, Setting
from ..settings.launch import LAUNCH, PARADIGM

_BOOL = "{true,false}"
_TYPES = {"int": int, "float": float}


@dataclass(frozen=True, slots=True)
class Flag:
    """One ``hasten launch`` option.

    ``path`` is the dotted config setting it fills (None for launch-only options); a ``switch`` takes
    no value and stores ``const`` (default True).
    """

    name: str
    group: str
    help: str
    path: str | None = None
    switch: bool = False
    const: object = True
    short: str | None = None
    type: type = str
    metavar: str | None = None
    lower: bool = False


def _row_flag(table: Section, row: Setting) -> Flag:
    """The option of a table's row: it fills the row's key (``distributed_type`` for a switch that chooses one), or,
    without key, is an option of the launch alone (typed by its kind)."""
    name, group, text = row.flag_name, row.group or table.group, row.flag_help
    if row.chooses is not None:
        return Flag(name, group, text, "distributed_type", switch=True, const=row.chooses, short=row.short)
    if not row.key:
        kind = _TYPES.get(row.kind, str)
        return Flag(name, group, text, switch=row.switch, short=row.short, type=kind, metavar=row.metavar)
    metavar = row.metavar or (_BOOL if row.kind == "bool" and not row.switch else None)
    path = table.path(row)
    return Flag(name, group, text, path, switch=row.switch, short=row.short, metavar=metavar, lower=row.lower)


def _flags() -> tuple[Flag, ...]:
    """Every option, by ``-h`` group (the launch table's groups, then the sections' own ones); within a group the
    engines' switches first, then the launch table's options, then the sections'."""
    switches = [
        Flag(engine.flag, PARADIGM, engine.flag_help, "distributed_type", switch=True, const=engine.distributed_type)
        for engine in environment.ENGINES
        if engine.flag
    ]
    launch = [_row_flag(LAUNCH, row) for row in LAUNCH.rows if row.flag_name]
    sections = [_row_flag(table, row) for table in SECTIONS for row in table.rows if row.flag_name]
    groups = dict.fromkeys([flag.group for flag in launch] + [table.group for table in SECTIONS])
    return tuple(flag for group in groups for flag in (*switches, *launch, *sections) if flag.group == group)


FLAGS: tuple[Flag, ...] = _flags()
_CHOOSERS = tuple(flag.name for flag in FLAGS if flag.path == "distributed_type")


def _metavar(flag: Flag) -> str | None:
    if flag.metavar or flag.path is None:
        return flag.metavar
    choices = leaf_fields()[flag.path].get("choices")
    return "{" + ",".join(str(c).lower() if flag.lower else str(c) for c in choices) + "}" if choices else None


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
        if flag.switch:
            group.add_argument(
                *names, dest=flag.name, action="store_const", const=flag.const, default=None, help=flag.help
            )
        else:
            group.add_argument(
                *names, dest=flag.name, default=None, type=flag.type, metavar=_metavar(flag), help=flag.help
            )
    parser.add_argument(
        "training_script", help="The script (or module, with -m) to run in every process, followed by its arguments."
    )
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)


def flag_settings(args: argparse.Namespace) -> dict[str, tuple[object, str]]:
    """Config settings given on the command line: dotted path -> (raw value, ``--flag``)."""
    given = [name for name in _CHOOSERS if getattr(args, name) is not None]
    if len(given) > 1 or (given and given[0] == "multi_gpu" and args.cpu):
        from ..errors import ConfigError

        chosen = given + (["cpu"] if args.cpu else [])
        names = "/".join(f"--{name}" for name in ("cpu", *_CHOOSERS))
        raise ConfigError(f"Pass at most one of {names}; got {', '.join('--' + n for n in chosen)}.")
    settings: dict[str, tuple[object, str]] = {}
    for flag in FLAGS:
        value = getattr(args, flag.name)
        if flag.path is not None and value is not None:
            settings[flag.path] = (value, f"--{flag.name}")
    return settings
