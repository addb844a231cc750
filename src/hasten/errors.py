"""The exceptions hasten raises.

Every failure caused by user input or by the environment is a :class:`HastenError` (or one of its
children), with a message that says what was wrong, what was expected and what to do. Several
children also inherit from the built-in exception a user would catch for the same problem
(``ValueError``, ``TypeError``, ``RuntimeError``), so ``except ValueError`` keeps working for code
ported from Accelerate.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class HastenError(Exception):
    """Base class of every error raised by hasten on purpose."""


class ConfigError(HastenError, ValueError):
    """A setting (argument, environment variable or config file entry) has an invalid value."""


class DistributedOperationException(HastenError, RuntimeError):
    """A collective was called with inputs that cannot match across processes (debug mode)."""


class DistributedSetupError(HastenError, RuntimeError):
    """The process group or the launch environment could not be set up."""


class CheckpointError(HastenError, RuntimeError):
    """A checkpoint is missing, incomplete or corrupt, or cannot be written."""


class CheckpointNotFoundError(CheckpointError, ValueError):
    """``load_state`` was given a folder that does not exist.

    A ``ValueError`` too, as Accelerate's ``load_state`` raises for the same call."""


class CheckpointTargetError(CheckpointError, FileExistsError):
    """``save_state`` was given an existing file (or a link to one) where a checkpoint folder belongs.

    A ``FileExistsError`` too, as Accelerate's ``save_state`` raises for the same call."""


class ConfigFileMissingError(HastenError, FileNotFoundError):
    """A command was given a config file that does not exist (a ``FileNotFoundError``, as in Accelerate)."""


class ConfigFileExistsError(HastenError, FileExistsError):
    """A command would overwrite a file it was not allowed to (a ``FileExistsError``, as in Accelerate)."""


class MissingDependencyError(HastenError, ImportError):
    """An optional package needed by the requested feature is not installed."""


class NotSupportedError(HastenError, NotImplementedError):
    """The requested feature exists in Accelerate but is not supported by hasten."""


def closest(name: str, choices: Iterable[str]) -> str | None:
    """Return the choice that looks most like ``name`` (for "did you mean" hints), or None."""
    matches = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return matches[0] if matches else None


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """A ``" Did you mean 'x'?"`` suffix, or an empty string when nothing is close."""
    match = closest(name, choices)
    return f" Did you mean {match!r}?" if match else ""


def require(package: str, feature: str, extra: str | None = None) -> None:
    """Import check for an optional dependency, raising :class:`MissingDependencyError` with the pip command."""
    import importlib.util

    if importlib.util.find_spec(package) is None:
        hint = f"pip install 'hasten[{extra}]'" if extra else f"pip install {package}"
        raise MissingDependencyError(
            f"{feature} needs the package {package!r}, which is not installed. Install it with: {hint}"
        )
