"""The process state: what it offers every process-aware object, and how the runtime guards the group it creates."""

import pytest
from helpers import SCRIPTS, clean_env, requires, torchrun

from hasten import process_group_hooks
from hasten.process_control import split_for_process
from hasten.state import PartialState, reset_state


@requires("datasets")
def test_split_for_process_gives_a_datasets_dataset_its_rows():
    import datasets

    data = datasets.Dataset.from_list([{"k": v} for v in range(5)])
    assert split_for_process(data, 2, 0)["k"] == [0, 1, 2]
    assert split_for_process(data, 2, 1)["k"] == [3, 4]
    assert split_for_process(data, 2, 1, apply_padding=True)["k"] == [3, 4, 4]
    assert isinstance(split_for_process(data, 2, 1), datasets.Dataset)


def test_split_for_process_padding():
    assert split_for_process([1, 2, 3], 2, 1, apply_padding=True) == [3, 3]
    assert split_for_process([1], 2, 1, apply_padding=True) == [1]
    with pytest.raises(ValueError, match="same length"):
        split_for_process({"a": [1], "b": [1, 2]}, 2, 0)


class _Recorder:
    """Guards that record what the state asks of them."""

    def __init__(self):
        self.calls = []

    def create_group(self, create, timeout):
        self.calls.append(("create_group", timeout))

    def start_watching(self):
        self.calls.append(("start_watching",))

    def barrier(self):
        self.calls.append(("barrier",))

    def set_debug(self, enabled):
        self.calls.append(("set_debug", enabled))

    def reset(self):
        self.calls.append(("reset",))


def test_the_state_tells_the_registered_guards(monkeypatch):
    recorder = _Recorder()
    reset_state()
    monkeypatch.setattr(process_group_hooks, "_provider", lambda: recorder)
    monkeypatch.setenv("HASTEN_DEBUG_MODE", "1")
    try:
        state = PartialState(cpu=True)
        state.debug = False
        state.wait_for_everyone()  # one process: no barrier
        reset_state()
    finally:
        monkeypatch.undo()
        reset_state()
    assert recorder.calls == [("set_debug", True), ("set_debug", False), ("reset",)]


def test_guards_must_be_registered(monkeypatch):
    with monkeypatch.context() as patched, pytest.raises(RuntimeError, match="import hasten"):
        patched.setattr(process_group_hooks, "_provider", None)
        process_group_hooks.guards()


def test_partial_state_alone_sets_up_the_runtime_guards():
    out = torchrun(SCRIPTS / "partial_state_alone.py", env=clean_env(HASTEN_DEBUG_MODE="1"), timeout=120).stdout
    assert "rank 0: partial state alone checks passed" in out and "rank 1: partial state alone checks passed" in out
