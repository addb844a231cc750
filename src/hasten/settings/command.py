"""The name the command line answers to in this process: ``hasten``, or ``accelerate`` where hasten's ``accelerate``
command started it. Messages about the launch config file suggest the command the user typed
(``accelerate config default``, not ``hasten config default``), and under the ``accelerate`` name the commands read
and write Accelerate's config file (:mod:`hasten.commands.config_location`).
"""

from __future__ import annotations

import os
import sys


def command_name() -> str:
    """``"accelerate"`` when this process was started as Accelerate's command (the ``accelerate`` console scripts of
    hasten's ``accelerate`` distribution, ``python -m accelerate.commands.<x>``), else ``"hasten"``."""
    started = getattr(sys.modules.get("__main__"), "__spec__", None)
    name = started.name if started is not None else os.path.basename(sys.argv[0] if sys.argv else "")
    return "accelerate" if name.startswith("accelerate") else "hasten"
