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
        tree._require_tensors({"labels": [torch.ones(1), torch.ones(1), "no"]}, "gather")
    with pytest.raises(TypeError, match=r"data\[1\] is a int.*reduce needs tensors"):
        ops.reduce([torch.ones(1), 5])


def test_recursively_apply_raises_accelerates_message_at_other_leaves():
    with pytest.raises(TypeError) as info:
        tree.recursively_apply(torch.tensor, (torch.tensor(1), 1), error_on_other_type=True)
    assert str(info.value) == (
        "Unsupported types (<class 'int'>) passed to `tensor`. Only nested list/tuple/dicts of objects that are valid "
        "for `is_torch_tensor` should be passed."
    )


def test_containers_are_walked_before_the_leaf_test():
    everything = tree.recursively_apply(lambda x: "leaf", [1, (2, {"a": 3})], test_type=lambda x: True)
    assert everything == ["leaf", ("leaf", {"a": "leaf"})], "a list is walked into even when the test accepts it"


def test_single_process_collectives():
    t = torch.tensor([1.0, 2.0])
    assert ops.gather(t) is t, "one process: gather returns its input, without a copy"
    scalar = torch.tensor(3.0)
    assert ops.gather(scalar) is scalar, "as in Accelerate, a 0-d tensor stays 0-d on one process"
    mixed = {"x": t, "note": "kept"}
    assert ops.gather(mixed) is mixed and ops.broadcast(mixed) is mixed, "one process: no check, no copy"
    assert ops.reduce(t, "sum") is not t, "reduce always returns a new tensor"
    assert ops.reduce(t, "sum").tolist() == [1.0, 2.0]
    items = [1, 2]
    assert ops.gather_object(items) is items and ops.gather_object("x") == "x", "one process: the object itself"
    assert ops.broadcast_object_list([1]) == [1]
    with pytest.raises(ValueError, match="reduction='avg'"):
        ops.reduce(t, "avg")


def test_pad_across_processes_on_one_process():
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    with pytest.warns(tree.CannotPadNestedTensorWarning):
        assert ops.pad_across_processes(nested) is nested
    t = torch.ones(2, 3)
    assert ops.pad_across_processes(t, dim=-4) is t and ops.pad_across_processes(t, dim=1) is t
    data = {"a": t}
    padded = ops.pad_across_processes(data)
    assert padded == data and padded is not data, "the structure is rebuilt, its tensors kept"
    with pytest.raises(TypeError, match=r"data\['b'\] is a str"):
        ops.pad_across_processes({"a": t, "b": "text"})


def test_send_to_device_skip_keys_and_objects_with_to():
    class Moves:
        def to(self, device, non_blocking=False):
            return ("moved", str(device))

    out = tree.send_to_device({"a": torch.ones(1), "b": torch.ones(1), "c": Moves()}, "cpu", skip_keys="b")
    assert out["c"] == ("moved", "cpu")


def test_send_to_device_moves_a_mapping_with_to_as_a_whole():
    class Encoding(dict):
        def to(self, device, non_blocking=False):
            self.moved = str(device)
            return self

    batch = Encoding(ids=torch.ones(2))
    assert tree.send_to_device(batch, "cpu", skip_keys="ids") is batch and batch.moved == "cpu", (
        "its own .to, as Accelerate"
    )


def test_concatenate_and_find_batch_size():
    parts = [{"x": torch.ones(2, 3), "y": [torch.zeros(2)]}, {"x": torch.ones(1, 3), "y": [torch.zeros(1)]}]
    out = tree.concatenate(parts)
    assert out["x"].shape == (3, 3) and out["y"][0].shape == (3,)
    assert tree.find_batch_size(out) == 3
    assert tree.ignorant_find_batch_size("nothing") is None


def test_concatenate_passes_a_single_value_through_and_refuses_others():
    assert tree.concatenate(["text"]) == "text"
    assert tree.concatenate([{"x": torch.ones(1), "name": "a"}])["name"] == "a"
    with pytest.raises(TypeError, match="2 values of type str"):
        tree.concatenate(["a", "b"])
    with pytest.raises(IndexError, match="empty"):
        tree.concatenate([])


def test_find_batch_size_follows_the_first_item_as_accelerate():
    with pytest.raises(ValueError, match=r"data\[0\] is an empty list"):
        tree.find_batch_size([[], torch.ones(4)])
    with pytest.raises(TypeError, match=r"data\['a'\] \(the first leaf\) is a int"):
        tree.find_batch_size({"a": 1, "b": torch.ones(4)})
    with pytest.raises(IndexError, match="0-dimensional"):
        tree.find_batch_size(torch.tensor(1.0))
    assert tree.ignorant_find_batch_size([[], torch.ones(4)]) is None


def test_structure_records_are_tensor_information():
    data = {"a": torch.ones(2, 3, dtype=torch.float16), "b": [torch.zeros(4, dtype=torch.int64)]}
    structure = tree.get_data_structure(data)
    assert structure["a"] == tree.TensorInformation(shape=torch.Size([2, 3]), dtype=torch.float16)
    fresh = tree.initialize_tensors(structure)
    assert fresh["a"].shape == (2, 3) and fresh["b"][0].dtype == torch.int64


def test_pad_input_tensors_and_convert_to_fp32():
    padded = tree.pad_input_tensors(torch.arange(1, 6), batch_size=5, num_processes=2)
    assert padded.tolist() == [1, 2, 3, 4, 5, 0], "Accelerate's size and zeros"
    assert tree.pad_input_tensors(torch.ones(3, 2), batch_size=3, num_processes=4).shape == (4, 2)
    assert tree.pad_input_tensors(torch.ones(8), batch_size=8, num_processes=4).shape == (10,), (
        "Accelerate pads even then"
    )
    out = tree.convert_to_fp32({"h": torch.ones(1, dtype=torch.float16), "i": torch.ones(1, dtype=torch.int64)})
    assert out["h"].dtype == torch.float32 and out["i"].dtype == torch.int64


def test_convert_outputs_to_fp32_can_be_undone_and_refuses_pickling():
    import pickle

    from hasten.runtime.wrappers import extract_model_from_parallel

    model = torch.nn.Linear(2, 2).half()
    model._original_forward = model.forward
    model.forward = tree.convert_outputs_to_fp32(model.forward)
    assert model(torch.ones(2, dtype=torch.float16)).dtype == torch.float32
    with pytest.raises(pickle.PicklingError, match="unwrap it first"):
        pickle.dumps(model.forward.__wrapped__)
    model = extract_model_from_parallel(model, keep_fp32_wrapper=False)
    assert "forward" not in model.__dict__ and "_original_forward" not in model.__dict__
    pickle.loads(pickle.dumps(model))


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
