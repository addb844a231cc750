"""Which launch config file a command reads or writes, and how it was chosen.

``hasten launch`` (``config``, ``env``, ``test``) reads, in this order: the file named by ``--config_file``; the file
named by ``HASTEN_CONFIG_FILE`` (or ``ACCELERATE_CONFIG_FILE``); hasten's default file
(:func:`hasten.environment.default_config_file`). When only Accelerate's default file exists, the launch summary says
so and how to use it.

Under Accelerate's name (the ``accelerate`` command of hasten's ``accelerate`` distribution,
``python -m accelerate.commands.<x>``, ``hasten launch --as_accelerate``) the default file is Accelerate's
(:func:`hasten.environment.accelerate_config_home`), found as Accelerate 1.15 finds it, and, as Accelerate does,
``launch --cpu`` reads no default file. hasten's own default file is read when Accelerate has none. Accelerate 1.15
reads no variable naming the file; ``ACCELERATE_CONFIG_FILE`` is hasten's, as every ``ACCELERATE_<NAME>`` setting.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .. import environment
from ..settings.command import command_name

DEFAULT_NAME = "default_config.yaml"


@dataclass(frozen=True, slots=True)
class ConfigLocation:
    """The launch config file a command uses: ``path`` (None: no file is read), ``source`` (how it was chosen, or
    why none was) and ``hint`` (what the user can do about it; may be empty)."""

    path: Path | None
    source: str
    hint: str = ""

    def describe(self) -> str:
        """One line for the launch summary: the file and how it was chosen, or ``none`` and what to do."""
        if self.path is None:
            return f"none ({self.source}{': ' + self.hint if self.hint else ''})"
        return f"{self.path} ({self.source})"


def speaks_accelerate(as_accelerate: bool = False) -> bool:
    """Whether the command runs under Accelerate's name: started as ``accelerate``, or ``hasten launch
    --as_accelerate`` (``as_accelerate``)."""
    return as_accelerate or command_name() == "accelerate"


def accelerate_default_file() -> Path:
    """Accelerate's default launch config file."""
    return environment.accelerate_config_home() / DEFAULT_NAME


def named_file(config_file: str | None) -> ConfigLocation | None:
    """The file named by ``--config_file`` or by ``HASTEN_CONFIG_FILE`` / ``ACCELERATE_CONFIG_FILE``; None when no
    file is named."""
    if config_file:
        return ConfigLocation(Path(config_file).expanduser(), "--config_file")
    variable = environment.setting_source("CONFIG_FILE")
    if variable:
        return ConfigLocation(Path(environment.get_str("CONFIG_FILE")).expanduser(), variable)
    return None


def file_to_write(config_file: str | None, accelerate: bool) -> Path:
    """Where ``config``, ``config default`` and ``config update`` write: the named file, else the default file of
    the name the command runs under."""
    named = named_file(config_file)
    if named is not None:
        return named.path
    return accelerate_default_file() if accelerate else environment.default_config_file()


def file_to_read(config_file: str | None, accelerate: bool, cpu: bool = False) -> ConfigLocation:
    """The launch config file to read (see the module's docstring for the order); ``cpu`` is ``launch --cpu``."""
    named = named_file(config_file)
    if named is not None:
        return named
    own, theirs = environment.default_config_file(), accelerate_default_file()
    name = command_name()
    if not accelerate:
        if own.is_file():
            return ConfigLocation(own, "hasten's default file")
        if theirs.is_file():
            return ConfigLocation(
                None,
                f"found Accelerate's {theirs}",
                f"`{name} config update` imports it, or pass it with --config_file",
            )
        return ConfigLocation(None, "no default file", f"run `{name} config` to create one")
    if cpu:
        found = next((path for path in (theirs, own) if path.is_file()), None)
        hint = f"pass --config_file {found} to use it" if found else ""
        return ConfigLocation(None, "launch --cpu reads no default file, as in Accelerate", hint)
    if theirs.is_file():
        return ConfigLocation(theirs, "Accelerate's default file")
    if own.is_file():
        return ConfigLocation(own, f"hasten's default file; Accelerate has none at {theirs}")
    return ConfigLocation(None, f"no default file at {theirs}", f"run `{name} config` to create one")
