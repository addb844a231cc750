"""The first code of every process ``hasten launch`` starts: tie the process's life to the launcher's,
then run the user's program in this same process.

A worker must not outlive its launcher, however the launcher ends (``kill -9`` and the kernel's
out-of-memory killer included: no handler runs then). On Linux the kernel does it: the worker asks
for SIGKILL when the thread that started it dies (``prctl(PR_SET_PDEATHSIG)``), before any user code
runs; elsewhere a daemon thread polls the parent's pid. Usage (the launcher builds these lines)::

    python -m hasten.commands.worker_bootstrap PARENT_PID train.py --lr 1e-3
    python -m hasten.commands.worker_bootstrap PARENT_PID -m package.module --lr 1e-3
    python -m hasten.commands.worker_bootstrap PARENT_PID --exec ./program --flag

A script runs as ``python train.py`` would run it (``__main__``, ``sys.argv``, ``sys.path[0]``); a
program given with ``--exec`` replaces this process (the parent-death signal survives ``exec``).
Python's output streams are line-buffered: each line reaches the log as soon as it is printed, and in
one write, so the lines of several processes sharing the launcher's output never mix (``python -u``
writes a line and its newline separately, and two processes' text then lands on one line).
"""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys
import threading
import time

_PR_SET_PDEATHSIG = 1
_POLL_SECONDS = 1.0
MODULE = "hasten.commands.worker_bootstrap"


def die_with_parent(parent_pid: int) -> None:
    """End this process (SIGKILL) as soon as the process ``parent_pid`` that started it is gone.

    Call it first thing in the child; ``parent_pid`` is the starter's pid as the starter saw it, which
    also catches a parent that died before this call.
    """
    if not (sys.platform.startswith("linux") and _set_parent_death_signal()):
        threading.Thread(target=_watch_parent, args=(parent_pid,), name="hasten-parent-watch", daemon=True).start()
    if os.getppid() != parent_pid:
        _end_self()


def _set_parent_death_signal() -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(_POLL_SECONDS)
    _end_self()


def _end_self() -> None:
    if hasattr(signal, "SIGKILL"):
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(1)


def command(parent_pid: int, program: list[str], module: bool = False, no_python: bool = False) -> list[str]:
    """The command line that starts ``program`` (a script and its arguments) through this bootstrap."""
    mode = ["--exec"] if no_python else ["-m"] if module else []
    return [sys.executable, "-m", MODULE, str(parent_pid), *mode, *program]


def run(argv: list[str]) -> None:
    """Run ``PARENT_PID [-m | --exec] TARGET ARGS...`` (see the module docstring)."""
    parent_pid, rest = int(argv[0]), argv[1:]
    die_with_parent(parent_pid)
    if rest[0] == "--exec":
        os.execvp(rest[1], rest[1:])
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, write_through=False)  # also under PYTHONUNBUFFERED=1
    if rest[0] == "-m":
        sys.argv = [rest[1], *rest[2:]]
        runpy.run_module(rest[1], run_name="__main__", alter_sys=True)
        return
    script = rest[0]
    sys.argv = list(rest)
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")


def _is_launch_frame(filename: str) -> bool:
    return filename in (__file__, "<frozen runpy>") or filename.endswith("runpy.py")


def _user_traceback(tb):
    """``tb`` without the frames of this bootstrap and of runpy, so that a traceback starts in the user's code."""
    while tb is not None and tb.tb_next is not None and _is_launch_frame(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return tb


def main() -> None:
    """Run as ``python -m``: an uncaught exception is reported as Python would, from the user's first frame."""
    try:
        run(sys.argv[1:])
    except Exception as exc:
        tb = _user_traceback(exc.__traceback__)
        exc.with_traceback(tb)
        sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, tb
        sys.excepthook(type(exc), exc, tb)
        sys.exit(1)


if __name__ == "__main__":
    main()
