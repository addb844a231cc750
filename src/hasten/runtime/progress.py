"""Progress bars shown once per machine, and readable in a log.

A bar redraws itself in place with carriage returns. That suits a terminal; in a log file or a pipe (a job's
output, CI) it leaves the bar's first state, ``0/23``, as the only readable line, as if nothing ran. Where the bar's
stream is not a terminal (and not a notebook), :func:`tqdm` therefore writes whole lines instead: one when the bar
closes (each epoch's bar gives its line, whether or not it is kept), and one every :data:`LOG_INTERVAL` seconds
meanwhile. ``mininterval`` / ``delay`` given by the caller still apply.
"""

from __future__ import annotations

import sys

LOG_INTERVAL = 30.0
"""Seconds between two lines of a running bar in a log."""


def tqdm(*args, main_process_only: bool = True, **kwargs):
    """``tqdm.auto.tqdm`` that is shown only on each machine's local main process (unless
    ``main_process_only=False``); in a log (a stream that is not a terminal), it writes a line per bar instead of
    redrawing one."""
    from tqdm.auto import tqdm as _tqdm

    if len(args) > 0 and isinstance(args[0], bool):
        raise TypeError(
            "hasten.utils.tqdm: pass main_process_only as a keyword (main_process_only=True), not as the first "
            "argument."
        )
    if main_process_only:
        from ..state import PartialState

        state = PartialState()
        kwargs["disable"] = kwargs.get("disable", False) or not state.is_local_main_process
    if _in_notebook(_tqdm) or _is_terminal(kwargs.get("file") or sys.stderr):
        return _tqdm(*args, **kwargs)
    kwargs.setdefault("mininterval", LOG_INTERVAL)
    kwargs.setdefault("maxinterval", max(kwargs["mininterval"], LOG_INTERVAL))
    kwargs.setdefault("delay", kwargs["mininterval"])
    return _log_lines_class(_tqdm)(*args, **kwargs)


def _in_notebook(cls: type) -> bool:
    """Whether tqdm.auto chose its notebook widget (whose output is not a terminal either)."""
    return any(base.__module__ == "tqdm.notebook" for base in cls.__mro__)


def _is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


_LOG_CLASSES: dict[type, type] = {}


def _log_lines_class(base: type) -> type:
    """``base`` (tqdm.auto's class) writing whole lines: each display is a line, the bar's end is always one."""
    if base not in _LOG_CLASSES:

        class LogLines(base):
            """A tqdm bar for logs: a line per display, none to clear, one line at the end."""

            def display(self, msg=None, pos=None):
                """Write the bar (or ``msg``) as a line; an empty ``msg`` (clearing the bar) writes nothing."""
                if msg == "":
                    return False
                self.fp.write(f"{self.__str__() if msg is None else msg}\n")
                self.fp.flush()
                return True

            def clear(self, nolock=False):
                """Nothing to clear: lines already written stay."""

            def refresh(self, nolock=False, lock_args=None):
                """Write a line unless one was written less than ``mininterval`` seconds ago (``set_postfix`` and
                ``tqdm.write`` refresh at every call)."""
                now, last = self._time(), getattr(self, "last_print_t", None)  # None: tqdm's first display
                if last is not None and now - last < self.mininterval:
                    return False
                shown = super().refresh(nolock=nolock, lock_args=lock_args)
                self.last_print_t = now
                return shown

            def close(self):
                """Write the bar's last state as a line (kept or not), then close it."""
                if not getattr(self, "disable", True):
                    self._ema_dt = lambda: None  # the overall rate, as a kept bar's last line shows
                    self.display()
                    self.leave = False
                    self.delay = float("inf")  # the line is written: tqdm has nothing left to show or clear
                super().close()

        LogLines.__name__ = LogLines.__qualname__ = f"LogLines{base.__name__}"
        _LOG_CLASSES[base] = LogLines
    return _LOG_CLASSES[base]
