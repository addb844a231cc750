"""Operations on nested structures in a single process."""

from collections import namedtuple

import pytest
import torch

from hasten.runtime import operations as ops
from hasten.runtime import tree

Pair = namedtuple("Pair", "a b")


def test_recursively_apply_keeps_structure_and_types():
    data = {"a": [torch.ones(1), (torch.zeros(2), 3)], "p": Pair(torch.ones(1), "x")}
    out = tree.recursively_apply(lambda t: t * 2, data)
    assert isinstance(out["p"], Pair) and out["p"].b == "x" and out["a"][1][1] == 3
    assert out["a"][0].item() == 2


def test_type_error_names_the_path():
    with pytest.raises(TypeError, match=r"data\['labels'\]\[2\] is a str"):
        ops.gather({"labels": [torch.ones(1), torch.ones(1), "no"]})
    with pytest.raises(TypeError, match=r"data\[1\] is a int"):
        ops.reduce([torch.ones(1), 5])


def test_single_process_collectives():
    t = torch.tensor([1.0, 2.0])
    assert ops.gather(t) is t, "one process: gather returns its input, without a copy"
    assert ops.reduce(t, "sum") is not t, "reduce always returns a new tensor"
    assert ops.gather(torch.tensor(3.0)).shape == (1,)
    assert ops.reduce(t, "sum").tolist() == [1.0, 2.0]
    assert ops.gather_object([1, 2]) == [1, 2] and ops.gather_object("x") == ["x"]
    assert ops.broadcast_object_list([1]) == [1]
    with pytest.raises(ValueError, match="reduction='avg'"):
        ops.reduce(t, "avg")


def test_send_to_device_skip_keys_and_objects_with_to():
    class Moves:
        def to(self, device, non_blocking=False):
            return ("moved", str(device))

    out = tree.send_to_device({"a": torch.ones(1), "b": torch.ones(1), "c": Moves()}, "cpu", skip_keys="b")
    assert out["c"] == ("moved", "cpu")


def test_concatenate_and_find_batch_size():
    parts = [{"x": torch.ones(2, 3), "y": [torch.zeros(2)]}, {"x": torch.ones(1, 3), "y": [torch.zeros(1)]}]
    out = tree.concatenate(parts)
    assert out["x"].shape == (3, 3) and out["y"][0].shape == (3,)
    assert tree.find_batch_size(out) == 3
    assert tree.ignorant_find_batch_size("nothing") is None


def test_pad_input_tensors_and_convert_to_fp32():
    padded = tree.pad_input_tensors(torch.arange(5), batch_size=5, num_processes=2)
    assert padded.tolist() == [0, 1, 2, 3, 4, 4]
    out = tree.convert_to_fp32({"h": torch.ones(1, dtype=torch.float16), "i": torch.ones(1, dtype=torch.int64)})
    assert out["h"].dtype == torch.float32 and out["i"].dtype == torch.int64


def test_split_for_process_padding():
    assert tree.split_for_process([1, 2, 3], 2, 1, apply_padding=True) == [3, 3]
    assert tree.split_for_process([1], 2, 1, apply_padding=True) == [1]
    with pytest.raises(ValueError, match="same length"):
        tree.split_for_process({"a": [1], "b": [1, 2]}, 2, 0)


def test_hang_timeout_precedence(monkeypatch):
    from hasten.runtime import hang_watchdog

    monkeypatch.delenv("HASTEN_HANG_TIMEOUT", raising=False)
    monkeypatch.delenv("ACCELERATE_HANG_TIMEOUT", raising=False)
    monkeypatch.setattr(hang_watchdog, "_group_timeout", None)
    assert hang_watchdog.hang_timeout() == hang_watchdog.DEFAULT_HANG_TIMEOUT == 300
    monkeypatch.setattr(hang_watchdog, "_group_timeout", 5400.0)  # InitProcessGroupKwargs(timeout=...)
    assert hang_watchdog.hang_timeout() == 5400.0
    monkeypatch.setenv("HASTEN_HANG_TIMEOUT", "42")
    assert hang_watchdog.hang_timeout() == 42.0


def test_the_hang_watchdog_records_each_collective_without_io():
    from hasten.runtime import hang_watchdog

    before = hang_watchdog.sequence()
    hang_watchdog.enter("gather")
    assert hang_watchdog._current[:2] == (before + 1, "gather")
    hang_watchdog.leave()
    assert hang_watchdog._current is None and hang_watchdog.sequence() == before + 1
    hang_watchdog.reset()  # one process: the watchdog stayed off; forget that for later tests
