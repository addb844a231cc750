"""Debug mode: ``HASTEN_DEBUG_MODE=1`` (also under plain torchrun), ``hasten launch --debug`` or ``debug: true``.

hasten's own collectives check their inputs across processes in every mode (see
:mod:`hasten.runtime.collective_check`), so debug mode adds only what Accelerate's adds beyond that:
functions that a script decorates with ``verify_operation`` are checked too (the shapes of their first
argument must match on every process). Hang reports (:mod:`hasten.runtime.hang_watchdog`) come in every mode.
"""

from __future__ import annotations

import torch.distributed as dist

from .. import environment
from ..settings.launch import DEBUG

_enabled: bool | None = None  # set by the process state when it starts (configure); None: read the environment


def configure(enabled: bool | None) -> None:
    """Turn debug mode on or off for this process (the state does it when it starts; None: follow
    ``HASTEN_DEBUG_MODE``)."""
    global _enabled
    _enabled = enabled


def active() -> bool:
    """True when user-decorated collectives should be checked: debug mode is on and several processes run."""
    enabled = _enabled if _enabled is not None else environment.launch_setting(DEBUG)
    return enabled and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
