"""The tracker contract (:class:`GeneralTracker`) and the rank gate its methods use.

A tracker is a small object with a ``name``, a ``requires_logging_directory`` flag, a ``tracker``
property (the run or writer it drives) and four methods: ``start``, ``store_init_configuration``,
``log`` and ``finish``. Built-in trackers and user-defined ones follow the same contract, so the
``Accelerator`` treats them alike.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, ClassVar

import torch.distributed as dist

from .. import environment
from ..errors import HastenError, require

_REQUIRED_ATTRIBUTES = ("name", "requires_logging_directory", "tracker")


class TrackerDefinitionError(HastenError, NotImplementedError):
    """A :class:`GeneralTracker` subclass lacks an attribute the contract requires.

    It is a ``NotImplementedError``, as in Accelerate, so existing ``except`` clauses keep working.
    """


def is_main_process() -> bool:
    """True on the process of global rank 0 (or when the job has a single process).

    Uses the process group when one exists, otherwise the launcher's ``RANK`` variables, so it works
    before and without an ``Accelerator``.
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return environment.detect_launch().rank == 0


def on_main_process(function: Callable) -> Callable:
    """Decorate a tracker method so that it runs only on the main process when the tracker says so.

    The method runs everywhere when its tracker has ``main_process_only = False``; otherwise it runs
    on the process of rank 0 and returns ``None`` elsewhere.

    Example:
        >>> class MyTracker(GeneralTracker):
        ...     name, requires_logging_directory = "mine", False
        ...     @on_main_process
        ...     def log(self, values, step=None, **kwargs):
        ...         print(step, values)
    """

    @functools.wraps(function)
    def run_on_main_process(self, *args, **kwargs):
        if getattr(self, "main_process_only", True) and not is_main_process():
            return None
        return function(self, *args, **kwargs)

    return run_on_main_process


class GeneralTracker:
    """Base class of every experiment tracker, built in or user-defined.

    A subclass must define, in its class body:

    - ``name`` (``str``): the name used in ``log_with``, ``init_kwargs``, ``log_kwargs`` and
      ``get_tracker``;
    - ``requires_logging_directory`` (``bool``): whether the constructor takes a logging directory
      after the run name (``Tracker(run_name, logging_dir, **init_kwargs)``) or not
      (``Tracker(run_name, **init_kwargs)``);
    - ``tracker``: a property returning the underlying run or writer (``get_tracker(name, unwrap=True)``).

    It may set ``main_process_only = False`` to run on every process instead of the main one only.
    Methods it does not override do nothing. A tracker passed as an instance in ``log_with`` is used
    as it is; ``start`` is still called by ``init_trackers``.

    Args:
        _blank: build an inert tracker that skips the attribute checks (what ``get_tracker`` returns
            on processes that run no tracker).

    Raises:
        TrackerDefinitionError: a required attribute is missing from the subclass.
        MissingDependencyError: a built-in tracker's package is not installed.
    """

    main_process_only: ClassVar[bool] = True
    # Package a built-in tracker imports, and the hasten extra that installs it.
    _package: ClassVar[str | None] = None
    _extra: ClassVar[str | None] = None

    def __init__(self, _blank: bool = False):
        if _blank:
            return
        cls = type(self)
        missing = [attr for attr in _REQUIRED_ATTRIBUTES if not hasattr(cls, attr)]
        if missing:
            names = ", ".join(f"`{attr}`" for attr in missing)
            raise TrackerDefinitionError(
                f"The tracker class {cls.__name__} is missing {names}. Every GeneralTracker subclass defines, in its "
                "class body, `name` (str), `requires_logging_directory` (bool) and a `tracker` property returning "
                "the underlying run or writer."
            )
        if not isinstance(cls.name, str) or not cls.name:
            raise TrackerDefinitionError(
                f"The tracker class {cls.__name__} has name={cls.name!r}; it must be a non-empty string."
            )
        if cls._package is not None:
            require(cls._package, f"The {cls.name!r} tracker", cls._extra)

    def start(self) -> None:
        """Create the underlying run or writer. Called once by ``init_trackers``, before anything is logged."""

    def store_init_configuration(self, values: dict) -> None:
        """Record the run's hyperparameters.

        Args:
            values: the configuration, already converted to JSON-compatible values (see
                :func:`hasten.tracking.values.sanitize_config`).
        """

    def log(self, values: dict, step: int | None = None, **kwargs) -> None:
        """Record the values of one step.

        Args:
            values: metric name -> number, string, or dict of numbers.
            step: the step the values belong to.
            **kwargs: tracker-specific options (from ``log_kwargs[name]``).
        """

    def finish(self) -> None:
        """Flush and close the run. Called by ``end_training``."""


class BlankTracker(GeneralTracker):
    """An inert tracker: every method and attribute is a no-op, so rank-agnostic user code never fails.

    ``get_tracker`` returns one on processes that run no tracker of the requested name. Any
    attribute read returns the blank tracker itself and calling it returns ``None``, so
    ``get_tracker("wandb", unwrap=True).log_artifact(...)`` does nothing on those processes.

    Args:
        name: the name that was asked for.
    """

    requires_logging_directory = False

    def __init__(self, name: str = "blank"):
        super().__init__(_blank=True)
        self.name = name

    @property
    def tracker(self) -> BlankTracker:
        """The blank tracker itself."""
        return self

    def __getattr__(self, attribute: str) -> Any:
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        return self

    def __call__(self, *args, **kwargs) -> None:
        return None

    def __repr__(self) -> str:
        return f"BlankTracker(name={self.name!r})"
