"""The hook through which the runtime guards the process group that the state creates.

``PartialState`` creates (or finds) the default process group, and from that moment the runtime's guards must be
on: the group's timeout fitted to the hang watchdog, the record of the group's connections that OOM recovery shuts
down, the hang watchdog itself (so that every process can answer for its stacks, even before its first
collective), debug mode, and a ``wait_for_everyone`` barrier that the watchdog sees. The state sits below the
runtime and imports none of it: it calls the :class:`GroupGuards` registered here. The package registers the
runtime's (:mod:`hasten.runtime.group_guards`) in ``hasten/__init__.py``, which every import of a hasten module
runs first, so the guards are in place before any state exists, also in a process that only builds
``PartialState()``. This module imports nothing, so that ``import hasten`` stays cheap.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Callable, Protocol


class GroupGuards(Protocol):
    """What the runtime does at each step of the process group's life."""

    def create_group(self, create: Callable[[dict], None], timeout: timedelta | None) -> None:
        """Create the default process group by calling ``create(options)`` (``options``: the keyword arguments
        of ``init_process_group`` the guards add, the timeout); ``timeout`` is the one the user gave, if any."""

    def start_watching(self) -> None:
        """The default process group exists (created or found): start watching its collectives."""

    def barrier(self) -> None:
        """Block until every process arrives (``wait_for_everyone``)."""

    def set_debug(self, enabled: bool | None) -> None:
        """Turn debug mode on or off (None: follow ``HASTEN_DEBUG_MODE``)."""

    def reset(self) -> None:
        """Forget what the state told the guards (``reset_state``)."""


_provider: Callable[[], GroupGuards] | None = None


def register(provider: Callable[[], GroupGuards]) -> None:
    """Make ``provider()`` the guards that the state calls from now on (``hasten/__init__.py`` registers the
    runtime's)."""
    global _provider
    _provider = provider


def guards() -> GroupGuards:
    """The registered guards."""
    if _provider is None:
        raise RuntimeError(
            "No process-group guards are registered: hasten.process_group_hooks.register() runs when the hasten "
            "package is imported; import hasten before creating a state."
        )
    return _provider()
