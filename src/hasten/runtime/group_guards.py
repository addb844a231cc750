"""The runtime's guards of the process group that the state creates: hasten's
:class:`~hasten.process_group_hooks.GroupGuards`, registered by ``hasten/__init__.py``.

- The group's timeout: the one the user gave (``InitProcessGroupKwargs(timeout=...)``), recorded for the hang
  watchdog, else the hang timeout plus a margin (:func:`default_group_timeout`).
- The group is created through :func:`~hasten.runtime.oom_recovery.create_default_group`, which records the
  connections that an OOM abort shuts down and the options that a rebuild reuses.
- The hang watchdog starts as soon as the group exists, created or found.
- Debug mode follows the state's ``debug``; ``wait_for_everyone`` is hasten's barrier, so that a hang report
  names it.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Callable

from .. import environment
from . import debug_mode, hang_watchdog, oom_recovery, operations


def default_group_timeout() -> timedelta | None:
    """The process group's timeout when the user gave none: the hang timeout plus a margin.

    A backstop: the hang watchdog reports a wait in any collective at the hang timeout, before this one
    fires; it still ends a wait the watchdog could not report (the rendezvous store gone). PyTorch's
    default (30 minutes for gloo) would leave such a job waiting long after. ``HASTEN_HANG_TIMEOUT=0``
    keeps PyTorch's default.
    """
    hang = environment.get_float("HANG_TIMEOUT", hang_watchdog.DEFAULT_HANG_TIMEOUT)
    return timedelta(seconds=hang + 60) if hang and hang > 0 else None


def create_group(create: Callable[[dict], None], timeout: timedelta | None) -> None:
    """Create the default process group with ``create(options)``, the timeout the user gave or
    :func:`default_group_timeout`, recording the group for OOM recovery."""
    hang_watchdog.set_group_timeout(timeout.total_seconds() if timeout is not None else None)
    timeout = timeout or default_group_timeout()
    options = {"timeout": timeout} if timeout is not None else {}
    oom_recovery.create_default_group(lambda: create(options), options)


def start_watching() -> None:
    """Start the hang watchdog (the group exists), so that every process can answer for its stacks, even before
    its first collective."""
    hang_watchdog.start()


def barrier() -> None:
    """hasten's barrier, seen by the hang watchdog and the collective check as ``wait_for_everyone``."""
    operations.barrier()


def set_debug(enabled: bool | None) -> None:
    """Debug mode on or off for this process (None: follow ``HASTEN_DEBUG_MODE``)."""
    debug_mode.configure(enabled)


def reset() -> None:
    """Forget the state's debug mode and the user's group timeout (``reset_state``)."""
    debug_mode.configure(None)
    hang_watchdog.set_group_timeout(None)
