"""The one reader of ``os.environ`` for settings: every variable hasten reads is listed in :data:`SETTINGS` with its
meaning; ``HASTEN_<NAME>`` wins, ``ACCELERATE_<NAME>`` is accepted as a fallback so that scripts and job files written
for Accelerate keep working. Reading a name that is not listed is a programming error (``KeyError``), which keeps the
list complete. The launch table's, the sections' and the engines' entries come from their rows (:mod:`hasten.settings`);
:func:`fill_unset` and :func:`launch_setting` read a row's variable typed by the row.

Also Accelerate's helpers that read any variable (``parse_flag_from_env``, ``parse_choice_from_env``,
``get_int_from_env``), which hasten's own settings do not use.
"""

from __future__ import annotations

import os
from typing import Any, Iterable

from ..errors import ConfigError
from ..settings import ACCELERATE_PREFIX, PREFIX, Setting, prefixed
from ..settings.dynamo import DYNAMO
from ..settings.engines import BUILT_IN, Engine, load_engines
from ..settings.fp8 import FP8
from ..settings.launch import LAUNCH
from ..settings.values import str_to_bool

# The engines hasten can run: the built-in registrations, then the modules named by HASTEN_ENGINES.
ENGINES: tuple[Engine, ...] = load_engines((*BUILT_IN, *os.environ.get(prefixed("ENGINES"), "").split(",")))


def _engine_variables() -> dict[str, str]:
    """The variables of the registered engines: switch, sections' rows, others."""
    found: dict[str, str] = {}
    for engine in ENGINES:
        if engine.switch:
            found[engine.switch] = engine.switch_help
        for section in engine.sections:
            found |= section.env_help()
        found |= engine.variables
    return found


# name (without prefix) -> meaning. Read as HASTEN_<name>, then ACCELERATE_<name>, then the extra aliases.
# The launch settings come from their rows in hasten.settings (the engines' from their registrations).
SETTINGS: dict[str, str] = {
    **LAUNCH.env_help(),
    "HANG_TIMEOUT": (
        "seconds a rank may wait in any collective before the job ends with a hang report (default: the "
        "InitProcessGroupKwargs timeout, else 300; 0 turns it off)"
    ),
    "HANG_REPORT_DIR": "folder where the rank that reports a hang writes hang_rank<N>.json for the launcher",
    "LOG_LEVEL": "default level of loggers made by hasten.logging.get_logger",
    "TORCH_DEVICE": "override the device string of every process (e.g. cuda:1)",
    **DYNAMO.env_help(),
    **_engine_variables(),
    **FP8.env_help(),
    "BYPASS_DEVICE_MAP": "let prepare() accept a model dispatched with a device_map",
    "INIT_INCLUDE_BUFFERS": "default include_buffers of init_empty_weights",
    "HOME": "folder of the default launch config file",
    "CONFIG_FILE": (
        "launch config file that `hasten launch`, `hasten config`, `env` and `test` use when --config_file is not "
        "given (before the default file)"
    ),
    "LAUNCHED": "set by `hasten launch` in the processes it starts",
    "LAUNCH_SOURCES": "JSON of where each launch setting came from (set by `hasten launch`)",
    "ENABLE_RICH": "accepted for compatibility; has no effect",
    "PREEMPTION_GRACE": (
        "seconds workers get after SIGTERM/SIGUSR1 to finish the step and save before they are killed (default 25)"
    ),
    "PREEMPTION_DIR": "folder where rank 0 records a preemption checkpoint for the launcher (set by `hasten launch`)",
    "ENGINES": "comma-separated modules registering more engines (hasten.settings.engines), read once per process",
}

# Settings that Accelerate reads without a prefix, accepted as a last fallback.
_BARE_ALIASES = {name: name for name in SETTINGS if name.startswith(("FSDP_", "PARALLELISM_CONFIG_"))}


def _lookup(name: str) -> tuple[str, str] | None:
    """Return (variable, value) for a listed setting, or None when it is unset."""
    if name not in SETTINGS:
        raise KeyError(f"hasten.environment: {name!r} is not listed in SETTINGS")
    candidates = [prefixed(name), prefixed(name, ACCELERATE_PREFIX)]
    if name in _BARE_ALIASES:
        candidates.append(_BARE_ALIASES[name])
    for var in candidates:
        value = os.environ.get(var)
        if value is not None:
            return var, value
    return None


def variable_name(name: str, prefix: str = PREFIX) -> str:
    """The variable that carries the listed setting ``name``: ``HASTEN_<name>`` (``prefix=ACCELERATE_PREFIX``:
    Accelerate's spelling), for a message that names it or a launcher that writes it.

    Raises:
        KeyError: ``name`` is not listed in :data:`SETTINGS`.
    """
    if name not in SETTINGS:
        raise KeyError(f"hasten.environment: {name!r} is not listed in SETTINGS")
    return prefixed(name, prefix)


def setting_source(name: str) -> str | None:
    """Name of the environment variable that provides setting ``name``, or None if unset."""
    found = _lookup(name)
    return found[0] if found else None


def get_str(name: str, default: str | None = None) -> str | None:
    """Read a listed setting as a string."""
    found = _lookup(name)
    return found[1] if found else default


def get_flag(name: str, default: bool = False) -> bool:
    """Read a listed setting as a boolean; an unparsable value names the variable."""
    found = _lookup(name)
    if found is None:
        return default
    var, value = found
    try:
        return bool(str_to_bool(value))
    except ConfigError:
        raise ConfigError(
            f"Environment variable {var}={value!r} is not a boolean; use 1/0, true/false or yes/no."
        ) from None


def get_int(name: str, default: int | None = None) -> int | None:
    """Read a listed setting as an integer; an unparsable value names the variable."""
    found = _lookup(name)
    if found is None or found[1] == "":
        return default
    var, value = found
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"Environment variable {var}={value!r} is not an integer.") from None


def get_float(name: str, default: float | None = None) -> float | None:
    """Read a listed setting as a float; an unparsable value names the variable."""
    found = _lookup(name)
    if found is None or found[1] == "":
        return default
    var, value = found
    try:
        return float(value)
    except ValueError:
        raise ConfigError(f"Environment variable {var}={value!r} is not a number.") from None


def read_setting(row: Setting) -> Any:
    """The value of a table row's variable, typed by the row's kind: a boolean (as :func:`get_flag`), an integer
    (as :func:`get_int`) or the text; None when unset. An empty variable counts as unset, except for a boolean."""
    found = _lookup(row.env_name)
    if found is None:
        return None
    if row.kind == "bool":
        return get_flag(row.env_name)
    if found[1] == "":
        return None
    if row.kind == "int" or (row.choices and isinstance(row.choices[0], int)):
        return get_int(row.env_name)
    return found[1]


def launch_setting(row: Setting | str) -> Any:
    """A launch table setting in this process: its row's variable (written by ``hasten launch``), typed as
    :func:`read_setting` types it, else the row's default (``launch_setting(USE_CPU)``, with the row of
    :mod:`hasten.settings.launch`; a top-level key, ``launch_setting("use_cpu")``, names the same row)."""
    row = LAUNCH.by_key(row) if isinstance(row, str) else row
    value = read_setting(row)
    return row.default if value is None else value


def any_set(rows: Iterable[Setting]) -> bool:
    """Whether the variable of any of ``rows`` that fill a plugin field is set."""
    return any(setting_source(row.env_name) for row in rows if row.field)


def fill_unset(obj: Any, rows: Iterable[Setting], fields: Iterable[str] | None = None) -> set[str]:
    """Fill every field of ``obj`` still None from its row: the row's variable, else its fallback.

    Only rows with a ``field`` (and, with ``fields``, only those fields) take part. Returns the fields
    set from a variable, so that the caller can tell them from its arguments.
    """
    from_env: set[str] = set()
    for row in rows:
        if row.field is None or (fields is not None and row.field not in fields) or getattr(obj, row.field) is not None:
            continue
        value = read_setting(row)
        if value is not None:
            from_env.add(row.field)
        setattr(obj, row.field, row.fallback if value is None else value)
    return from_env


# --------------------------------------------------------------- any variable (Accelerate's helpers)


def parse_flag_from_env(key: str, default: bool = False) -> bool:
    """Read an arbitrary environment variable as a boolean (Accelerate's helper; hasten's own settings use
    :func:`get_flag`)."""
    value = os.environ.get(key)
    return default if value is None else bool(str_to_bool(value))


def parse_choice_from_env(key: str, default: str = "no") -> str:
    """Read an arbitrary environment variable as a string, with a default."""
    return os.environ.get(key, str(default))


def get_int_from_env(env_keys: list[str], default: int) -> int:
    """The first non-negative integer found among ``env_keys``, else ``default``."""
    for key in env_keys:
        value = int(os.environ.get(key, -1))
        if value >= 0:
            return value
    return default
