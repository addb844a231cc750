"""Device maps: sizes, budgets and the planner's own contract (clear errors, in-place size strings, budgets kept).

Where the planner places what is checked against Accelerate 1.15 itself, case by generated case, in
test_differential_big_modeling.py; the tests here pin what hasten promises on top (messages) and the fixes of
issue 22, each of which failed before its fix.

Sizes used below (float32): Linear(10, 10) = 100*4 + 10*4 = 440 bytes, so a Block (two of them) is
880; Embedding(20, 10) = 800; Linear(10, 5) = 200 + 20 = 220. Model total = 800 + 4*880 + 220 = 4540.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict

import pytest
import torch
from torch import nn

from hasten.big_modeling import init_empty_weights
from hasten.big_modeling.device_map import (
    check_device_map,
    clean_device_map,
    convert_file_size_to_int,
    get_balanced_memory,
    get_max_memory,
    infer_auto_device_map,
)
from hasten.big_modeling.modeling import compute_module_sizes, dtype_byte_size, get_max_layer_size
from hasten.errors import ConfigError


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(10, 10)
        self.b = nn.Linear(10, 10)


class Model(nn.Module):
    def __init__(self, tied: bool = False):
        super().__init__()
        self.embed = nn.Embedding(20, 10)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(10, 20 if tied else 5)
        if tied:
            self.head.weight = self.embed.weight


def _model(**kwargs) -> Model:
    with init_empty_weights():
        return Model(**kwargs)


def _top(model: nn.Module) -> list:
    return (
        list(model.named_parameters(recurse=False))
        + list(model.named_children())
        + list(model.named_buffers(recurse=False))
    )


def test_module_sizes_by_hand():
    sizes = compute_module_sizes(_model())
    assert sizes[""] == 4540
    assert (sizes["embed"], sizes["blocks"], sizes["blocks.0"], sizes["blocks.0.a"], sizes["head"]) == (
        800,
        3520,
        880,
        440,
        220,
    )
    half = compute_module_sizes(_model(), dtype="float16", special_dtypes={"head.weight": torch.float64})
    assert (half[""], half["embed"], half["head"]) == (2270 - 110 + 410, 400, 410)


def test_a_dtype_never_widens_and_integers_keep_their_size():
    module = nn.Linear(4, 4, dtype=torch.float16)
    module.register_buffer("ids", torch.arange(8))
    assert compute_module_sizes(module, dtype=torch.float32)[""] == 20 * 2 + 8 * 8


def test_bool_is_one_eighth_of_a_byte_as_in_accelerate():
    assert dtype_byte_size(torch.bool) == 1 / 8
    assert dtype_byte_size(torch.float8_e4m3fn) == 1 and dtype_byte_size(torch.int4) == 0
    module = nn.Module()
    module.register_buffer("mask", torch.zeros(20, dtype=torch.bool))
    assert compute_module_sizes(module)[""] == 2.5


def test_tied_weights_are_counted_once():
    sizes = compute_module_sizes(_model(tied=True))
    assert sizes["embed"] == 800 and sizes["head"] == 80  # the head's weight is the embedding's
    assert sizes[""] == 800 + 3520 + 80


def test_max_layer_size():
    model = _model()
    sizes = compute_module_sizes(model)
    assert get_max_layer_size(_top(model), sizes, ["Block"]) == (880, [f"blocks.{i}" for i in range(4)])
    assert get_max_layer_size(_top(model), sizes, []) == (800, ["embed"])


def test_size_strings_follow_accelerate():
    assert convert_file_size_to_int("1.5GiB") == int(1.5 * 2**30) and convert_file_size_to_int("10MB") == 10**7
    assert convert_file_size_to_int("10Mb") == 10**7 // 8 and convert_file_size_to_int(123) == 123
    for bad in ("100", "1TB", "-5MB", "lots"):
        with pytest.raises(ValueError, match="Invalid size"):
            convert_file_size_to_int(bad)


def test_get_max_memory_converts_the_callers_strings_in_place():
    # transformers' from_pretrained(..., max_memory={"cpu": "60KB"}) reads its dict again afterwards
    max_memory = {"cpu": "60KB", 1: "2GiB", "disk": "10GB", 0: 100}
    budgets = get_max_memory(max_memory)
    assert max_memory == {"cpu": 60_000, 1: 2**31, "disk": 10**10, 0: 100}
    assert list(budgets.items()) == [(0, 100), (1, 2**31), ("cpu", 60_000), ("disk", 10**10)]
    assert get_max_memory()["cpu"] > 0


def test_get_max_memory_errors_name_the_fix():
    with pytest.raises(ConfigError, match=r"key 'cuda:0' is not a device: use GPU indices as ints"):
        get_max_memory({"cuda:0": "1GB"})
    with pytest.raises(ConfigError, match="'gpu' is not a device"):
        get_max_memory({"gpu": "1GB"})
    with pytest.raises(ConfigError, match="Invalid size 'lots'"):
        get_max_memory({"cpu": "lots"})


def test_infer_auto_device_map_converts_strings_and_returns_an_ordered_dict():
    max_memory = {0: "10KB", "cpu": "30KB"}
    device_map = infer_auto_device_map(_model(), max_memory)
    assert max_memory == {0: 10_000, "cpu": 30_000}
    assert isinstance(device_map, OrderedDict) and device_map == {"": 0}


def test_balanced_memory_without_gpus_is_the_budgets():
    assert get_balanced_memory(_model(), {"cpu": "5KB"}) == {"cpu": 5000}


def test_budgets_are_respected_and_blocks_never_split():
    model = _model()
    sizes = compute_module_sizes(model)
    for gpu in (900, 1500, 1800, 2700):
        for cpu in (0, 1000, 2600):
            budgets = {0: gpu, 1: gpu, "cpu": cpu}
            device_map = infer_auto_device_map(model, budgets, no_split_module_classes=["Block"], clean_result=False)
            used = {device: sum(sizes[name] for name, d in device_map.items() if d == device) for device in budgets}
            assert all(used[device] <= budgets[device] for device in budgets), (budgets, device_map)
            assert not any(name.count(".") > 1 and name.startswith("blocks.") for name in device_map), device_map
            check_device_map(model, device_map)


def test_a_device_left_empty_is_logged_as_insufficient_memory(caplog):
    """Accelerate's tests (and users grepping logs) look for "insufficient memory" when a device gets nothing;
    with fallback_allocation a smaller module is placed there instead and nothing is logged."""
    inner = nn.Sequential(
        OrderedDict([("linear1", nn.Linear(10, 4)), ("linear2", nn.Linear(4, 4)), ("linear3", nn.Linear(4, 8))])
    )
    model = nn.Sequential(OrderedDict([("module", inner)]))
    with caplog.at_level("INFO", logger="hasten"):
        assert dict(infer_auto_device_map(model, {0: 256})) == {"": "disk"}
    assert "0 for insufficient memory: 336 bytes would be needed" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="hasten"):
        placed = infer_auto_device_map(model, {0: 256}, fallback_allocation=True)
    assert placed == {"module.linear2": 0, "module.linear1": "disk", "module.linear3": "disk"}
    assert "insufficient memory" not in caplog.text


def test_check_device_map_errors_and_warnings():
    model = _model()
    with pytest.raises(ConfigError, match=r"gives no device to these tensors: blocks\.3\.a\.weight"):
        check_device_map(model, {"embed": 0, "blocks.0": 0, "blocks.1": 0, "blocks.2": 0, "head": 0})
    with pytest.warns(
        UserWarning, match=r"do not match any submodules in the model: \['blokcs'\].*Did you mean 'blocks'"
    ):
        check_device_map(model, {"": 0, "blokcs": 0})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_device_map(model, {"": 0})


def test_verbose_prints_decisions(capsys):
    infer_auto_device_map(_model(), {"cpu": 2000}, no_split_module_classes=["Block"], verbose=True)
    out = capsys.readouterr().out
    assert "'embed' (800 bytes with no tied modules) goes on 'cpu'" in out and "moving to the next device" in out


def test_clean_device_map_collapses_entries_sharing_a_device():
    mixed = {"a.0": 0, "a.1": 0, "b": "cpu"}
    assert clean_device_map(mixed) is mixed and mixed == {"a": 0, "b": "cpu"}
    assert list(mixed) == ["b", "a"]  # a merged entry moves to the end, as in Accelerate
    assert clean_device_map({"a.0": 0, "a.1": 0, "b": 0}) == {"": 0}
    assert clean_device_map({"m.a.0": 0, "m.a.1": 0, "m.b": "cpu", "c": "disk"}) == {
        "m.a": 0,
        "m.b": "cpu",
        "c": "disk",
    }
    assert clean_device_map({"m.a.0": 0, "m.a.1": 0, "m.b": 1}, module_name="m.a") == {"m.a": 0, "m.b": 1}
    assert clean_device_map({"a": 0}) == {"a": 0} and clean_device_map({}) == {}
