"""Python stacks for hang reports: this process's threads, its child processes, and a process that cannot answer.

A process answers a stack request from its hang watchdog thread, which needs the GIL. Two cases need
more than that, and :mod:`faulthandler` covers both: its handler runs in C, without the GIL.

- A process whose thread holds the GIL in C code (an extension's long loop) cannot run the watchdog
  thread. :func:`install` registers faulthandler on :data:`DUMP_SIGNAL` (SIGUSR2), writing into an
  unnamed temporary file of its own (nothing is left behind, however the process ends); a process on
  the same machine then signals it and reads the file through ``/proc/<pid>/fd`` (:func:`dump_other`).
  Linux only, like the ``/proc`` check that a process has the handler before it is signalled.
- Child processes (DataLoader workers) have no watchdog. Forked ones inherit the handler and the file,
  so :func:`describe_children` signals each of them that still has it and shows its stacks; every
  child is named with its pid, state and command line.

SIGUSR2 is taken only while nobody else handles it: a script or library that installed its own handler
keeps it, and such a process is then not signalled.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

_LIBRARY = ("/site-packages/", "/dist-packages/", "/hasten/", "/contextlib.py", "/threading.py", "runpy")

DUMP_SIGNAL = getattr(signal, "SIGUSR2", None)
_DUMP_WAIT = 2.0  # seconds a signalled process gets to write its stacks
_installed: dict = {}  # pid -> (path, open file) of this process's dump file


def install() -> str | None:
    """Register faulthandler on :data:`DUMP_SIGNAL` for this process; returns the dump file's path for other
    processes (None: not taken, or no ``/proc``)."""
    pid = os.getpid()
    if pid in _installed:
        return _installed[pid][0]
    if DUMP_SIGNAL is None or signal.getsignal(DUMP_SIGNAL) is not signal.SIG_DFL or not os.path.isdir("/proc/self/fd"):
        return None
    handle = tempfile.TemporaryFile("w+")  # noqa: SIM115 - stays open: faulthandler writes into it until the end
    faulthandler.register(DUMP_SIGNAL, file=handle, all_threads=True, chain=False)
    _installed[pid] = (f"/proc/{pid}/fd/{handle.fileno()}", handle)
    return _installed[pid][0]


def dump_path() -> str | None:
    """This process's dump file while its faulthandler still owns :data:`DUMP_SIGNAL` (nobody replaced it since)."""
    found = _installed.get(os.getpid())
    return found[0] if found is not None and signal.getsignal(DUMP_SIGNAL) is signal.SIG_DFL else None


def own_threads() -> str:
    """The stacks of this process's Python threads (the calling one left out), the main thread first."""
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    me = threading.get_ident()
    frames = sorted(sys._current_frames().items(), key=lambda item: item[0] != main)
    parts = [
        f"Thread {names.get(ident, ident)}:\n{''.join(traceback.format_stack(frame))}"
        for ident, frame in frames
        if ident != me
    ]
    return "\n".join(parts) or "(no Python thread besides the watchdog)"


def dump_other(pid: int, path: str | None) -> str | None:
    """Signal process ``pid`` (this machine) to write its stacks into ``path``; returns them (None: nothing came)."""
    if path is None or not _catches_dump_signal(pid):
        return None
    return _signal_and_read(pid, path)


def _signal_and_read(pid: int, path: str) -> str | None:
    try:
        start = os.path.getsize(path)
        os.kill(pid, DUMP_SIGNAL)
    except OSError:
        return None
    deadline, size = time.monotonic() + _DUMP_WAIT, start
    while time.monotonic() < deadline:
        time.sleep(0.05)
        with contextlib.suppress(OSError):
            grown = os.path.getsize(path)
            if grown > start and grown == size:  # it stopped growing: the dump is complete
                break
            size = grown
    with contextlib.suppress(OSError), open(path, "rb") as handle:
        handle.seek(start)
        text = handle.read().decode(errors="replace")
        return text or None
    return None


def _catches_dump_signal(pid: int) -> bool:
    """Whether ``pid`` has a handler for :data:`DUMP_SIGNAL` (Linux ``/proc``); an unhandled one would end it."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    for line in status.splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (DUMP_SIGNAL - 1) & 1)
    return False


def describe_children(pid: int, path: str | None) -> str:
    """Every child process of ``pid`` (DataLoader workers, ...): pid, state, command; the stacks of forked ones."""
    import psutil

    try:
        parent = psutil.Process(pid)
        children = parent.children(recursive=True)
        command = parent.cmdline()
    except psutil.Error:
        return ""
    parts = []
    for child in children:
        try:
            status, child_command = child.status(), child.cmdline()
        except psutil.Error:
            continue
        forked = child_command == command  # a fork of the process (a DataLoader worker), not a program it started
        kind = "a fork of this process (e.g. a DataLoader worker)" if forked else " ".join(child_command)[:120]
        stacks = _signal_and_read(child.pid, path) if forked and path and _catches_dump_signal(child.pid) else None
        parts.append(f"Child process {child.pid} ({status}): {kind}\n{stacks or '(no Python stack available)'}")
    return "\n".join(parts)


def user_frames(stack: str, count: int = 3) -> list[list[str]]:
    """The innermost ``count`` frames of a process's stacks as :func:`own_threads` or faulthandler write them,
    leaving out torch's, hasten's and the standard library's; each frame a list of lines (the ``File`` line, then
    the source line when there is one). The main thread is read (faulthandler: the thread it marks current)."""
    blocks = [block for block in stack.split("\n\n") if 'File "' in block]
    current = next((block for block in blocks if block.startswith("Current thread")), None)
    block = current or (blocks[0] if blocks else "")
    first_thread = block.split("\nThread ", 1)[0]
    frames: list[list[str]] = []
    for line in first_thread.splitlines():
        text = line.strip()
        if text.startswith('File "'):
            frames.append([text])
        elif text and frames and not set(text) <= set("^~ "):
            frames[-1].append(text)
    if "most recent call first" in first_thread:
        frames.reverse()
    mine = [frame for frame in frames if not any(part in frame[0] for part in _LIBRARY)]
    return (mine or frames)[-count:]
