"""``hasten.utils.tqdm`` in a log (a stream that is not a terminal): a whole line per bar, its last state, instead of
the redrawn bar whose only readable state was ``0/23``; in a terminal, tqdm's own bar."""

from __future__ import annotations

import io

import pytest

from hasten.runtime import progress
from hasten.utils import tqdm


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def _one_process(monkeypatch):
    """A plain process is its machine's main process: the bars are shown."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


def test_a_log_gets_a_line_per_bar_with_its_last_state():
    log = io.StringIO()
    for epoch in range(3):
        for _ in tqdm(range(23), desc=f"epoch {epoch}", leave=False, file=log):
            pass
    lines = log.getvalue().split("\n")
    assert [line.split("|")[0] for line in lines[:-1]] == [f"epoch {epoch}: 100%" for epoch in range(3)], lines
    assert all("| 23/23 [" in line for line in lines[:-1]) and lines[-1] == ""
    assert "\r" not in log.getvalue() and "0/23" not in log.getvalue()


def test_a_running_bar_writes_a_line_at_most_every_interval():
    log = io.StringIO()
    bar = tqdm(total=50, initial=10, desc="training", file=log)
    for step in range(40):
        bar.update(1)
        bar.set_postfix(loss=step)  # refreshes at every call: no line of its own within the interval
        if step == 20:
            bar.write("a message", file=log)
    bar.close()
    assert log.getvalue().split("\n")[0] == "a message"
    (last,) = log.getvalue().split("\n")[1:-1]
    assert last.startswith("training: 100%|") and "| 50/50 [" in last and last.endswith("loss=39]"), last
    assert progress.LOG_INTERVAL == 30.0
    lines = io.StringIO()
    bar = tqdm(total=3, desc="slow", file=lines, mininterval=0)  # the caller's interval applies
    for _ in range(3):
        bar.update(1)
    bar.close()
    assert lines.getvalue().count("slow: ") == 5  # the first state, a line per update, the last state again


def test_a_terminal_keeps_the_redrawn_bar():
    screen = _Terminal()
    bar = tqdm(range(3), desc="epoch 0", file=screen)
    assert type(bar).__name__ == "tqdm_asyncio" and not type(bar).__name__.startswith("LogLines")
    list(bar)
    assert "\r" in screen.getvalue() and "0/3" in screen.getvalue()


def test_a_bar_of_another_process_writes_nothing(monkeypatch):
    monkeypatch.setattr("hasten.state.PartialState.is_local_main_process", property(lambda self: False))
    log = io.StringIO()
    assert list(tqdm(range(3), file=log)) == [0, 1, 2]
    assert log.getvalue() == ""
