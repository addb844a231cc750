"""The trackers of one training run, and which process drives which (what the ``Accelerator`` holds)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping

from ..enums import LoggerType
from ..errors import ConfigError, HastenError, did_you_mean
from ._common import as_step
from .base import BlankTracker, GeneralTracker
from .registry import LOGGER_TYPE_TO_CLASS, filter_trackers
from .values import sanitize_config, tensors_to_numbers


class TrackerHub:
    """Builds, starts, feeds and finishes the trackers named by ``log_with``.

    The ``Accelerator`` holds one and forwards ``init_trackers``, ``log``, ``get_tracker`` and
    ``end_training`` to it; it can also be used alone. ``log_with`` is checked here, at
    construction, on every process, so a missing package or logging directory fails before training.

    Only the main process builds and drives a tracker, unless the tracker sets
    ``main_process_only = False``; on the other processes ``log`` does nothing (and converts
    nothing, so it costs no device synchronisation) and ``get`` returns a :class:`BlankTracker`.

    Args:
        log_with: tracker names, ``"all"``, :class:`GeneralTracker` instances, or a list of these.
        logging_dir: the folder for trackers that write files (TensorBoard, JSON lines).
        is_main_process: whether this process is the main one (global rank 0).

    Raises:
        MissingDependencyError: a requested tracker's package is not installed.
        ConfigError: an unknown tracker, or a file-writing tracker without ``logging_dir``.
    """

    def __init__(self, log_with=None, logging_dir: str | os.PathLike | None = None, is_main_process: bool = True):
        self.log_with = filter_trackers(log_with, logging_dir)
        self.logging_dir = None if logging_dir is None else os.fspath(logging_dir)
        self.is_main_process = is_main_process
        self._trackers: list[GeneralTracker] = []
        self._initialized = False

    @property
    def trackers(self) -> list[GeneralTracker]:
        """The trackers running on this process (empty before ``init`` and after ``finish``)."""
        return self._trackers

    @property
    def names(self) -> list[str]:
        """Names of every tracker requested in ``log_with``, whether or not it runs on this process."""
        return [entry.name if isinstance(entry, GeneralTracker) else str(entry) for entry in self.log_with]

    def _runs_here(self, tracker) -> bool:
        return self.is_main_process or not tracker.main_process_only

    def _check_kwargs_keys(self, kwargs: Mapping, argument: str) -> None:
        known = set(LOGGER_TYPE_TO_CLASS) | set(self.names) | (set(LoggerType.list()) - {LoggerType.ALL.value})
        unknown = [key for key in kwargs if key not in known]
        for key in unknown:
            warnings.warn(
                f"{argument} has an entry for {key!r}, which is not a tracker; it is ignored. "
                f"Trackers: {', '.join(sorted(known))}.{did_you_mean(key, known)}",
                UserWarning,
                stacklevel=4,
            )

    def _build(self, entry, project_name: str, init_kwargs: Mapping) -> GeneralTracker | None:
        if isinstance(entry, GeneralTracker):
            return entry if self._runs_here(entry) else None
        name = str(entry)
        tracker_class = LOGGER_TYPE_TO_CLASS[name]
        if not self._runs_here(tracker_class):
            return None
        kwargs = dict(init_kwargs.get(name) or {})
        try:
            if tracker_class.requires_logging_directory:
                return tracker_class(project_name, self.logging_dir, **kwargs)
            return tracker_class(project_name, **kwargs)
        except TypeError as error:
            raise ConfigError(
                f"init_kwargs[{name!r}]={kwargs!r} does not fit {tracker_class.__name__}: {error}"
            ) from error

    def init(self, project_name: str, config=None, init_kwargs: Mapping | None = None) -> None:
        """Build and start the trackers of this process, then store ``config`` in each.

        Args:
            project_name: the run's name; file-writing trackers write to ``logging_dir/project_name``.
            config: hyperparameters (dict, dataclass or ``argparse.Namespace``); values that cannot be
                stored are converted (tensors, paths, enums, ...) or named in one warning.
            init_kwargs: per-tracker constructor arguments, e.g. ``{"wandb": {"entity": "team"}}``.

        Raises:
            ConfigError: called twice without ``finish``, a bad ``project_name``/``config``, or
                ``init_kwargs`` a tracker does not accept.
        """
        if self._initialized:
            raise ConfigError(
                "init_trackers() was already called for this run; call end_training() before starting another run."
            )
        if not isinstance(project_name, str) or not project_name:
            raise ConfigError(f"init_trackers(project_name=...) must be a non-empty string, got {project_name!r}.")
        init_kwargs = init_kwargs or {}
        self._check_kwargs_keys(init_kwargs, "init_trackers(init_kwargs=...)")
        built = [self._build(entry, project_name, init_kwargs) for entry in self.log_with]
        built = [tracker for tracker in built if tracker is not None]
        stored = None if config is None else sanitize_config(config, warn=bool(built))
        self._initialized = True
        for tracker in built:
            tracker.start()
            self._trackers.append(tracker)
        if stored is not None:
            for tracker in self._trackers:
                tracker.store_init_configuration(stored)

    def log(self, values: Mapping, step: int | None = None, log_kwargs: Mapping | None = None) -> None:
        """Send ``values`` to every tracker of this process.

        One-element tensors become Python numbers first, with one device-to-host copy per
        (device, dtype) group for all trackers together.

        Args:
            values: metric name -> value.
            step: the step the values belong to.
            log_kwargs: per-tracker options, e.g. ``{"wandb": {"commit": False}}``.

        Raises:
            ConfigError: on the main process, ``log_with`` names trackers but ``init`` was not called
                (Accelerate silently drops such values).
        """
        if not self._initialized:
            if self.is_main_process and self.log_with:
                raise ConfigError(
                    "log() was called before init_trackers(), so nothing would be recorded for "
                    f"{', '.join(self.names)}. Call accelerator.init_trackers(project_name, config=...) once before "
                    "logging."
                )
            return
        if not self._trackers:
            return
        if not isinstance(values, Mapping):
            raise ConfigError(f"log(values=...) must be a dict of metric name -> value, got {type(values).__name__}.")
        log_kwargs = log_kwargs or {}
        self._check_kwargs_keys(log_kwargs, "log(log_kwargs=...)")
        values = tensors_to_numbers(values)
        step = as_step(step)
        for tracker in self._trackers:
            tracker.log(values, step=step, **(log_kwargs.get(tracker.name) or {}))

    def get(self, name: str, unwrap: bool = False):
        """The tracker called ``name`` (or, with ``unwrap``, its run/writer).

        On a process that does not run that tracker, returns a :class:`BlankTracker` whose every
        method does nothing, so code like ``get_tracker("tensorboard").log_images(...)`` runs on all ranks.

        Raises:
            ConfigError: ``name`` is not among the requested trackers (when any were requested), or
                ``init`` was not called yet on the main process.
        """
        for tracker in self._trackers:
            if tracker.name == name:
                return tracker.tracker if unwrap else tracker
        if not self.log_with:
            return BlankTracker(name)
        if name not in self.names:
            raise ConfigError(
                f"get_tracker({name!r}): no tracker of that name; this run logs with {', '.join(self.names)}."
                f"{did_you_mean(name, self.names)}"
            )
        if self.is_main_process and not self._initialized:
            raise ConfigError(
                f"get_tracker({name!r}) was called before init_trackers(); call init_trackers(project_name) first."
            )
        return BlankTracker(name)

    def finish(self) -> None:
        """Finish every tracker of this process (all are tried even if one fails), then forget them.

        Raises:
            HastenError: one or more trackers failed to finish; the message names each.
        """
        failures = []
        for tracker in self._trackers:
            try:
                tracker.finish()
            except Exception as error:  # every tracker gets its chance to flush before reporting
                failures.append((tracker.name, error))
        self._trackers = []
        self._initialized = False
        if failures:
            details = "; ".join(f"{name}: {type(error).__name__}: {error}" for name, error in failures)
            raise HastenError(
                f"Some trackers failed to finish, their last values may be missing: {details}"
            ) from failures[0][1]
