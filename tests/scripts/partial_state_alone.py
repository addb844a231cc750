"""``PartialState()`` alone, as transformers' ``TrainingArguments`` builds it, before anything else of hasten.

Importing the state imports none of the runtime; creating it still sets up everything the runtime guards the
process group with: the hang watchdog, debug mode, the group's record for OOM recovery, the user's timeout, and a
``wait_for_everyone`` that the watchdog sees. Run by tests/test_state.py on 2 processes with HASTEN_DEBUG_MODE=1.
"""

import sys
import threading
from datetime import timedelta

from hasten.state import PartialState

loaded = sorted(name for name in sys.modules if name.startswith("hasten.runtime"))
assert not loaded, f"importing hasten.state imported the runtime: {loaded}"

state = PartialState(timeout=1234)

from hasten.runtime import debug_mode, hang_watchdog, oom_recovery  # noqa: E402  (after the state, on purpose)

assert "hasten-hang-watchdog" in {thread.name for thread in threading.enumerate()}, "the hang watchdog did not start"
assert debug_mode.active(), "debug mode is off"
assert hang_watchdog.hang_timeout() == 1234.0, hang_watchdog.hang_timeout()
assert oom_recovery._group["options"] == {"timeout": timedelta(seconds=1234)}, oom_recovery._group
before = hang_watchdog.sequence()
state.wait_for_everyone()
assert hang_watchdog.sequence() == before + 1, "wait_for_everyone did not pass through hasten's barrier"
print(f"rank {state.process_index}: partial state alone checks passed", flush=True)
