"""Logging that knows about processes: log once (main process) or from every rank, in rank order if asked.

``from hasten.logging import get_logger`` replaces ``logging.getLogger``; each call takes
``main_process_only=True`` (default) and ``in_order=False``.
"""

from __future__ import annotations

import logging

from . import environment
from .errors import DistributedSetupError


class MultiProcessAdapter(logging.LoggerAdapter):
    """A logger adapter whose calls take ``main_process_only`` and ``in_order``.

    Calling it before the process state exists is an error whatever the level (as in Accelerate, so a
    misplaced call fails the same way in development and in production): create the ``Accelerator``
    (or a ``PartialState``) first, so the adapter knows which process it is on.
    """

    @staticmethod
    def _state():
        from .state import PartialState, process_state_exists

        if not process_state_exists():
            raise DistributedSetupError(
                "hasten's logger was used before the process state exists. Create the Accelerator (or "
                "hasten.PartialState()) before logging, e.g. move `accelerator = Accelerator()` above the first log "
                "call."
            )
        return PartialState()

    def log(self, level, msg, *args, **kwargs):
        """Log ``msg`` on the main process (``main_process_only=True``), or on all processes, in rank order with
        ``in_order=True``."""
        main_process_only = kwargs.pop("main_process_only", True)
        in_order = kwargs.pop("in_order", False)
        kwargs.setdefault("stacklevel", 2)
        state = self._state()
        if not self.isEnabledFor(level):
            return
        if main_process_only:
            if state.is_main_process:
                msg, kwargs = self.process(msg, kwargs)
                self.logger.log(level, msg, *args, **kwargs)
            return
        if not in_order:
            msg, kwargs = self.process(msg, kwargs)
            self.logger.log(level, msg, *args, **kwargs)
            return
        for rank in range(state.num_processes):
            if rank == state.process_index:
                text, options = self.process(msg, dict(kwargs))
                self.logger.log(level, text, *args, **options)
                for handler in self.logger.handlers + logging.getLogger().handlers:
                    handler.flush()
            state.wait_for_everyone()

    def warning_once(self, *args, **kwargs):
        """``warning`` that is emitted once per distinct message."""
        key = (args, tuple(sorted(kwargs.items())))
        if key in _warned_once:
            return
        _warned_once.add(key)
        self.warning(*args, **kwargs)


_warned_once: set = set()


def get_logger(name: str, log_level: str | None = None) -> MultiProcessAdapter:
    """A :class:`MultiProcessAdapter` around ``logging.getLogger(name)``.

    Args:
        name: the logger's name, usually ``__name__``.
        log_level: ``"DEBUG"``, ``"INFO"``, ... (default: ``HASTEN_LOG_LEVEL``, else unchanged).
    """
    level = log_level if log_level is not None else environment.get_str("LOG_LEVEL")
    logger = logging.getLogger(name)
    if level is not None:
        logger.setLevel(level.upper())
        logger.root.setLevel(level.upper())
    return MultiProcessAdapter(logger, {})
