"""One table per group of launch settings: each setting is declared once, as a :class:`Setting` row.

From a section's rows hasten builds the config file's dataclasses (:mod:`hasten.config`), the
``hasten launch`` flags (:mod:`hasten.commands.launch_args`), the documented environment variables
(:data:`hasten.environment.SETTINGS`), the ``hasten config`` questions (:mod:`hasten.commands.config`)
and the values the processes read from the environment (:func:`hasten.environment.fill_unset`,
:func:`hasten.environment.launch_setting`).

This package imports neither torch nor the hasten modules built on it, so that the command line
stays fast. Tables: :mod:`.launch` (the top-level keys and the other ``hasten launch`` options, and
``mpirun_config``), :mod:`.dynamo` (``dynamo_config``), :mod:`.deepspeed` (``deepspeed_config``),
:mod:`.fsdp` (``fsdp_config``), :mod:`.fp8` (``fp8_config``), :mod:`.parallelism` (``parallelism_config``).
The engines and the sections they bring are listed by :mod:`.engines`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# A setting named NAME travels in the variable HASTEN_NAME; ACCELERATE_NAME, Accelerate's spelling, is read when that
# is unset (and written where libraries built on Accelerate read it).
PREFIX = "HASTEN_"
ACCELERATE_PREFIX = "ACCELERATE_"


def prefixed(name: str, prefix: str = PREFIX) -> str:
    """The variable of the setting ``name`` (without prefix): ``HASTEN_<name>``, or Accelerate's spelling with
    ``prefix=ACCELERATE_PREFIX``."""
    return f"{prefix}{name}"


@dataclass(frozen=True, slots=True)
class Question:
    """How ``hasten config`` asks for a setting.

    A boolean ``default`` makes it a yes/no question; a setting with choices is picked from
    ``options`` (default: all its choices); an integer (at least 1) or a number is typed in; anything
    else is free text (``must_exist``: the path of an existing file), and an empty answer leaves the
    key out. ``step`` orders the section's questions, ``stage`` groups them (the dialogue asks one
    stage at a time), ``when`` = (other key, allowed answers) asks only after one of those answers,
    and a ``fixed`` question is not asked: ``default`` is written.
    """

    text: str = ""
    default: Any = False
    step: int = 0
    stage: str = "main"
    options: tuple | None = None
    when: tuple[str, tuple] | None = None
    fixed: bool = False
    must_exist: bool = False


@dataclass(frozen=True, slots=True)
class Setting:
    """One launch setting.

    Args:
        key: its key in the config file's section; None for a setting only read from the environment.
        kind: how a value is checked (see :func:`hasten.settings.values.convert`): bool, int, float,
            float_or_auto, str, list, choice, bool_or_strategy, bool3 or any.
        choices: the allowed values of a ``choice`` (or ``bool_or_strategy``).
        env: the variable's name without prefix (read as ``HASTEN_<env>``, then ``ACCELERATE_<env>``);
            default: ``key`` in upper case; None: no variable.
        env_help: what the variable means (listed in :data:`hasten.environment.SETTINGS`).
        flag: the ``hasten launch`` option (without ``--``); ``""`` is ``key``, None is no option.
        flag_help: the option's help text.
        switch: the option takes no value (it stores true).
        lower: the dialogue and the launch option show the choices in lower case.
        field: the plugin field filled from the variable when left unset.
        fallback: the plugin field's value when neither the argument nor the variable gives one.
        question: how ``hasten config`` asks for it (None: not asked).
        always_export: ``hasten launch`` exports the variable whatever the distributed type (the
            section's ``only_with`` does not apply).
        default: the config file's value when no source sets the key (top-level keys; a section's keys
            are None, "not set", and their plugin's ``fallback`` applies).
        group: the ``hasten launch -h`` group of the option (default: its section's ``group``).
        short: the option's one-letter spelling (``-q``).
        metavar: how the help shows the option's value.
        chooses: the option is a switch that sets ``distributed_type`` to this value (``--multi_gpu``).
        flag_default: the option's value in the parsed flags when it is left off the command line (what
            Accelerate's launch parser gives there, text included: ``"true"`` for an FSDP option); such a value is
            never taken as given, so the config file, the environment and the plugin's ``fallback`` still apply.
        flag_type: how the option's text is parsed (default: ``int`` for an ``int`` kind, ``float`` for a ``float``
            one, else the text as given).

    A row with neither ``key`` nor variable but with a ``flag`` is an option of ``hasten launch`` alone
    (``--quiet``, ``--max_restarts``): an ``int`` or ``float`` one is parsed as such.
    """

    key: str | None
    kind: str = "str"
    choices: tuple | None = None
    env: str | None = ""
    env_help: str = ""
    flag: str | None = ""
    flag_help: str = ""
    switch: bool = False
    lower: bool = False
    field: str | None = None
    fallback: Any = None
    question: Question | None = None
    always_export: bool = False
    default: Any = None
    group: str = ""
    short: str | None = None
    metavar: str | None = None
    chooses: str | None = None
    flag_default: Any = None
    flag_type: Any = None

    @property
    def env_name(self) -> str | None:
        """The variable's name without prefix, or None."""
        return str(self.key).upper() if self.env == "" else self.env

    @property
    def flag_name(self) -> str | None:
        """The launch option's name without ``--``, or None."""
        return self.key if self.flag == "" else self.flag

    @property
    def variable(self) -> str | None:
        """The variable that carries it (``HASTEN_<env_name>``), or None."""
        return prefixed(self.env_name) if self.env_name else None


@dataclass(frozen=True, slots=True)
class Section:
    """A config file section and its rows, in the order of the ``hasten launch`` options.

    ``only_with`` is the distributed type under which ``hasten launch`` exports the section's
    variables to the processes (None: always); ``group`` is the ``hasten launch -h`` group of its
    options. The launch table's ``name`` is empty: its keys are the file's top-level keys.
    """

    name: str
    class_name: str
    doc: str
    rows: tuple[Setting, ...]
    only_with: str | None = None
    group: str = ""

    def by_field(self, name: str) -> Setting:
        """The row that fills plugin field ``name``."""
        return next(row for row in self.rows if row.field == name)

    def by_key(self, key: str) -> Setting:
        """The row of config key ``key``."""
        return next(row for row in self.rows if row.key == key)

    def path(self, row: Setting) -> str:
        """The dotted config path of ``row`` (its key alone in the launch table)."""
        return f"{self.name}.{row.key}" if self.name else str(row.key)

    def env_paths(self) -> dict[str, str]:
        """Dotted config path -> variable name (without prefix) for the rows with a config key."""
        return {self.path(row): row.env_name for row in self.rows if row.key and row.env_name}

    def env_help(self) -> dict[str, str]:
        """Variable name (without prefix) -> meaning, for :data:`hasten.environment.SETTINGS`."""
        return {row.env_name: row.env_help for row in self.rows if row.env_name}
