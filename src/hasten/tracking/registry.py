"""Tracker names -> classes, and turning ``log_with`` into a checked list of trackers."""

from __future__ import annotations

import importlib.util
import os
import warnings

from ..enums import LoggerType
from ..errors import ConfigError, did_you_mean, require
from .aim_tracker import AimTracker
from .base import GeneralTracker
from .clearml_tracker import ClearMLTracker
from .comet_tracker import CometMLTracker
from .dvclive_tracker import DVCLiveTracker
from .jsonl_tracker import JSONLTracker
from .mlflow_tracker import MLflowTracker
from .swanlab_tracker import SwanLabTracker
from .tensorboard_tracker import TensorBoardTracker
from .trackio_tracker import TrackioTracker
from .wandb_tracker import WandBTracker

# Name -> class of every tracker usable by name in ``log_with``; register_tracker_class adds to it.
LOGGER_TYPE_TO_CLASS: dict[str, type[GeneralTracker]] = {
    "tensorboard": TensorBoardTracker,
    "wandb": WandBTracker,
    "mlflow": MLflowTracker,
    "jsonl": JSONLTracker,
    "aim": AimTracker,
    "comet_ml": CometMLTracker,
    "clearml": ClearMLTracker,
    "dvclive": DVCLiveTracker,
    "trackio": TrackioTracker,
    "swanlab": SwanLabTracker,
}

LogWith = str | LoggerType | GeneralTracker

# What Accelerate's ``log_with="all"`` may select: its own trackers (not hasten's ``jsonl``).
_ACCELERATE_TRACKERS = set(LoggerType.list()) - {LoggerType.ALL.value, LoggerType.JSONL.value}


def _installed(tracker_class: type[GeneralTracker]) -> bool:
    package = tracker_class._package
    return package is None or importlib.util.find_spec(package) is not None


def get_available_trackers() -> list[LoggerType]:
    """Accelerate's trackers that can run here (their package is installed), as :class:`~hasten.enums.LoggerType`
    members.

    ``log_with="all"`` means this list, as in Accelerate: it does not add hasten's ``jsonl`` tracker nor
    registered custom trackers (name those explicitly).
    """
    return [
        LoggerType(name)
        for name in LoggerType.list()
        if name in _ACCELERATE_TRACKERS and name in LOGGER_TYPE_TO_CLASS and _installed(LOGGER_TYPE_TO_CLASS[name])
    ]


def register_tracker_class(tracker_class: type[GeneralTracker]) -> type[GeneralTracker]:
    """Make a :class:`GeneralTracker` subclass usable by its ``name`` in ``log_with`` (also as a decorator).

    ``init_trackers`` then builds it as ``tracker_class(project_name, logging_dir, **init_kwargs[name])``
    when ``requires_logging_directory`` is true, else ``tracker_class(project_name, **init_kwargs[name])``.

    Args:
        tracker_class: the class to register.

    Returns:
        ``tracker_class``, unchanged.

    A name already registered is taken over by ``tracker_class``, with a ``UserWarning`` (as in Accelerate):
    shadowing a built-in tracker's name replaces that tracker.

    Raises:
        ConfigError: it is not a GeneralTracker subclass, or has no string ``name`` or no
            ``requires_logging_directory``.
    """
    if not (isinstance(tracker_class, type) and issubclass(tracker_class, GeneralTracker)):
        raise ConfigError(
            f"register_tracker_class expects a subclass of hasten.tracking.GeneralTracker, got {tracker_class!r}."
        )
    name = getattr(tracker_class, "name", None)
    if not isinstance(name, str) or not name:
        raise ConfigError(
            f"{tracker_class.__name__} needs a class attribute `name` (a non-empty string) to be registered."
        )
    if name == LoggerType.ALL.value:
        raise ConfigError("'all' is reserved for every available tracker; choose another `name`.")
    if not hasattr(tracker_class, "requires_logging_directory"):
        raise ConfigError(
            f"{tracker_class.__name__} needs a class attribute `requires_logging_directory`: True when its constructor "
            "takes the logging directory (after the project name), else False."
        )
    existing = LOGGER_TYPE_TO_CLASS.get(name)
    if existing is not None and existing is not tracker_class:
        warnings.warn(
            f"A tracker named {name!r} is already registered ({existing.__module__}.{existing.__qualname__}); "
            f"{tracker_class.__name__} replaces it for log_with={name!r}. Give it another `name` to keep both.",
            UserWarning,
            stacklevel=2,
        )
    LOGGER_TYPE_TO_CLASS[name] = tracker_class
    return tracker_class


def _resolve_name(entry: str) -> str:
    """The registered name ``entry`` refers to (exact, then case-insensitive), or an error."""
    text = str(entry)
    if text in LOGGER_TYPE_TO_CLASS or text == LoggerType.ALL.value:
        return text
    if text.lower() in LOGGER_TYPE_TO_CLASS or text.lower() == LoggerType.ALL.value:
        return text.lower()
    known = [*LOGGER_TYPE_TO_CLASS, LoggerType.ALL.value]
    raise ConfigError(
        f"log_with={text!r} is not a known tracker; choose from {', '.join(known)}.{did_you_mean(text, known)}"
    )


def _check_usable(name: str, logging_dir, requested_as: str) -> None:
    tracker_class = LOGGER_TYPE_TO_CLASS[name]
    if tracker_class._package is not None:
        require(tracker_class._package, f"The {name!r} tracker ({requested_as})", tracker_class._extra)
    if tracker_class.requires_logging_directory and logging_dir is None:
        raise ConfigError(
            f"Logging with `{name}` requires a `logging_dir` to be passed in ({requested_as}): the tracker writes "
            "files, and no logging directory is set. Pass Accelerator(project_dir=...) or "
            "Accelerator(project_config=ProjectConfiguration(logging_dir=...))."
        )


def _as_entry(name: str) -> LoggerType | str:
    return LoggerType(name) if name in LoggerType.list() else name


def filter_trackers(log_with, logging_dir: str | os.PathLike | None = None) -> list[LogWith]:
    """Check ``log_with`` and return the trackers it asks for, in order and without duplicates.

    Differs from Accelerate on purpose: a tracker whose package is missing is an error with the pip
    command (Accelerate drops it with a debug message, so nothing gets logged), and so is a tracker
    that needs a logging directory when none is set (including through ``"all"``).

    Args:
        log_with: ``None``, a name (``"tensorboard"``, ``LoggerType.WANDB``, ``"all"``), a
            :class:`GeneralTracker` instance, or a list of these.
        logging_dir: the folder trackers that write files use.

    Returns:
        :class:`~hasten.enums.LoggerType` members for built-in names, strings for registered names,
        and the tracker instances as given.

    Raises:
        MissingDependencyError: a requested tracker's package is not installed.
        ConfigError: an unknown name, or a file-writing tracker without ``logging_dir``.
    """
    if log_with is None:
        return []
    entries = list(log_with) if isinstance(log_with, (list, tuple)) else [log_with]
    selected: list[LogWith] = []
    seen: set[str] = set()
    for entry in entries:
        if isinstance(entry, GeneralTracker):
            selected.append(entry)
            continue
        if isinstance(entry, type) and issubclass(entry, GeneralTracker):
            raise ConfigError(
                f"log_with got the class {entry.__name__}; pass an instance ({entry.__name__}(...)) or call "
                f"register_tracker_class({entry.__name__}) and pass its name {getattr(entry, 'name', '?')!r}."
            )
        if not isinstance(entry, (str, LoggerType)):
            raise ConfigError(f"log_with entries must be tracker names or GeneralTracker instances, got {entry!r}.")
        name = _resolve_name(entry)
        names = [str(n) for n in get_available_trackers()] if name == LoggerType.ALL.value else [name]
        for item in names:
            if item not in seen:
                _check_usable(item, logging_dir, f"log_with={entry!r}")
                seen.add(item)
                selected.append(_as_entry(item))
    return selected
