"""Device maps: sizes, budgets, and infer_auto_device_map against hand-computed placements.

Sizes used below (float32): Linear(10, 10) = 100*4 + 10*4 = 440 bytes, so a Block (two of them) is
880; Embedding(20, 10) = 800; Linear(10, 5) = 200 + 20 = 220. Model total = 800 + 4*880 + 220 = 4540.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hasten.big_modeling import init_empty_weights
from hasten.big_modeling.device_map import check_device_map, get_balanced_memory, get_max_memory, infer_auto_device_map
from hasten.errors import ConfigError
from hasten.big_modeling.modeling import compute_module_sizes, get_max_layer_size, module_parts


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


def test_module_sizes_by_hand():
    sizes = compute_module_sizes(_model())
    assert sizes[""] == 4540
    assert (sizes["embed"], sizes["blocks"], sizes["blocks.0"], sizes["blocks.0.a"], sizes["head"]) == (800, 3520, 880, 440, 220)
    assert sizes["blocks.0.a.weight"] == 400
    half = compute_module_sizes(_model(), dtype="float16", special_dtypes={"head.weight": torch.float64})
    assert (half[""], half["embed"], half["head"]) == (2270 - 110 + 410, 400, 410)


def test_tied_weights_are_counted_once():
    sizes = compute_module_sizes(_model(tied=True))
    assert sizes["embed"] == 800 and sizes["head"] == 80  # the head's weight is the embedding's
    assert sizes[""] == 800 + 3520 + 80


def test_integer_buffers_keep_their_size_under_dtype():
    module = nn.Linear(4, 4)
    module.register_buffer("ids", torch.arange(8))
    assert compute_module_sizes(module, dtype=torch.float16)[""] == 16 * 2 + 4 * 2 + 8 * 8


def test_max_layer_size():
    model = _model()
    sizes = compute_module_sizes(model)
    assert get_max_layer_size(module_parts(model, ""), sizes, ["Block"]) == (880, [f"blocks.{i}" for i in range(4)])
    assert get_max_layer_size(module_parts(model, ""), sizes, []) == (800, ["embed"])


def test_get_max_memory_parses_and_orders():
    budgets = get_max_memory({"cpu": "1GB", 1: "2GiB", "disk": "10GB", "cuda:0": 100})
    assert list(budgets.items()) == [(0, 100), (1, 2**31), ("cpu", 10**9), ("disk", 10**10)]
    assert get_max_memory()["cpu"] > 0
    with pytest.raises(ConfigError, match="max_memory key 'gpu' is not a device"):
        get_max_memory({"gpu": "1GB"})
    with pytest.raises(ConfigError, match="Invalid size"):
        get_max_memory({"cpu": "lots"})


def test_whole_model_fits_first_device():
    assert infer_auto_device_map(_model(), {0: 10_000, "cpu": 10_000}) == {"": 0}


def test_no_split_blocks_stay_whole_and_offload_reserves_room():
    # Pass 1: GPU 0 takes embed (800) + blocks.0 (1680); blocks.1 would make 2560 > 2500 -> GPU 1 takes
    # blocks.1, blocks.2; blocks.3 goes to the CPU. Something is offloaded, so pass 2 keeps the largest
    # block (880) free on GPU 0: 2500 - 880 = 1620 holds embed only.
    device_map = infer_auto_device_map(_model(), {0: 2500, 1: 2500, "cpu": 10_000}, no_split_module_classes=["Block"])
    assert list(device_map.items()) == [
        ("embed", 0),
        ("blocks.0", 1),
        ("blocks.1", 1),
        ("blocks.2", "cpu"),
        ("blocks.3", "cpu"),
        ("head", "cpu"),
    ]


def test_blocks_are_split_without_no_split_classes():
    # embed 800 + blocks.0 880 = 1680, + blocks.1.a 440 = 2120; blocks.1.b would make 2560 -> GPU 1
    # takes blocks.1.b, blocks.2, blocks.3, head = 440 + 880 + 880 + 220 = 2420 <= 2500. Nothing offloaded.
    device_map = infer_auto_device_map(_model(), {0: 2500, 1: 2500, "cpu": 10_000})
    assert list(device_map.items()) == [
        ("embed", 0),
        ("blocks.0", 0),
        ("blocks.1.a", 0),
        ("blocks.1.b", 1),
        ("blocks.2", 1),
        ("blocks.3", 1),
        ("head", 1),
    ]


def test_cpu_and_disk_without_accelerators():
    # CPU budget 2000 minus the largest block (880) leaves 1120: embed (800) fits, blocks.0 does not.
    budgets = {"cpu": 2000}
    device_map = infer_auto_device_map(_model(), budgets, no_split_module_classes=["Block"])
    assert list(device_map.items()) == [("embed", "cpu"), ("blocks", "disk"), ("head", "disk")]
    raw = infer_auto_device_map(_model(), budgets, no_split_module_classes=["Block"], clean_result=False)
    assert list(raw.items()) == [("embed", "cpu")] + [(f"blocks.{i}", "disk") for i in range(4)] + [("head", "disk")]


def test_tied_weights_are_placed_together():
    # Pass 2 keeps 880 free on GPU 0 (limit 1120): embed + head (800 + its bias 80) fit together,
    # blocks.0 does not; the head comes last in the model but joins the embedding on GPU 0.
    device_map = infer_auto_device_map(_model(tied=True), {0: 2000, "cpu": 10_000}, no_split_module_classes=["Block"])
    assert list(device_map.items()) == [("embed", 0), ("blocks", "cpu"), ("head", 0)]


def test_fallback_allocation_fills_an_empty_device():
    def model():
        with init_empty_weights():
            return nn.Sequential(nn.Linear(30, 30), nn.Linear(5, 5), nn.Linear(30, 30))  # 3720, 120, 3720 bytes

    # Offloading keeps 3720 free on GPU 0 (limit 280): the first layer cannot go there.
    assert infer_auto_device_map(model(), {0: 4000, "cpu": 100_000}) == {"": "cpu"}
    device_map = infer_auto_device_map(model(), {0: 4000, "cpu": 100_000}, fallback_allocation=True)
    assert list(device_map.items()) == [("0", "cpu"), ("1", 0), ("2", "cpu")]


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


def test_balanced_memory_by_hand():
    model = _model()
    # share = ceil(4540 / 2) + int(1.25 * 880) = 2270 + 1100 = 3370; the last GPU keeps its budget.
    budgets = get_balanced_memory(model, {0: 10_000, 1: 10_000, "cpu": 500}, no_split_module_classes=["Block"])
    assert budgets == {0: 3370, 1: 10_000, "cpu": 500}
    device_map = infer_auto_device_map(model, budgets, no_split_module_classes=["Block"])
    assert list(device_map.items()) == [
        ("embed", 0),
        ("blocks.0", 0),
        ("blocks.1", 0),
        ("blocks.2", 1),
        ("blocks.3", 1),
        ("head", 1),
    ]
    low = get_balanced_memory(model, {0: 10_000, 1: 10_000, 2: 10_000}, no_split_module_classes=["Block"], low_zero=True)
    assert low == {0: 0, 1: 3370, 2: 10_000}
    assert get_balanced_memory(model, {0: 1000, "cpu": 5}) == {0: 1000, "cpu": 5}


def test_check_device_map_errors():
    model = _model()
    with pytest.raises(ConfigError, match=r"gives no device to these tensors: blocks\.3\.a\.weight"):
        check_device_map(model, {"embed": 0, "blocks.0": 0, "blocks.1": 0, "blocks.2": 0, "head": 0})
    with pytest.raises(ConfigError, match="'blokcs' is not a module, parameter or buffer of the model. Did you mean 'blocks'"):
        check_device_map(model, {"": 0, "blokcs": 0})


def test_verbose_prints_decisions(capsys):
    infer_auto_device_map(_model(), {"cpu": 2000}, no_split_module_classes=["Block"], verbose=True)
    out = capsys.readouterr().out
    assert "Placing 'embed' on 'cpu'" in out and "keeping 880 bytes free" in out


def test_buffers_of_offloaded_modules_warn_when_they_do_not_fit():
    class WithBuffer(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(10, 10)
            self.register_buffer("table", torch.zeros(1000))

    with init_empty_weights():
        model = nn.Sequential(nn.Linear(10, 10), WithBuffer())
    with pytest.warns(UserWarning, match="4000 bytes of buffers.*offload_buffers=True"):
        infer_auto_device_map(model, {"cpu": 1000})


def test_clean_device_map_collapses_entries_sharing_a_device():
    from hasten.big_modeling.device_map import clean_device_map

    mixed = {"a.0": 0, "a.1": 0, "b": "cpu"}
    assert clean_device_map(mixed) is mixed and mixed == {"a": 0, "b": "cpu"}
    assert clean_device_map({"a.0": 0, "a.1": 0, "b": 0}) == {"": 0}
    assert clean_device_map({"m.a.0": 0, "m.a.1": 0, "m.b": "cpu", "c": "disk"}) == {"m.a": 0, "m.b": "cpu", "c": "disk"}
    assert clean_device_map({"m.a.0": 0, "m.a.1": 0, "m.b": 1}, module_name="m.a") == {"m.a": 0, "m.b": 1}
    assert clean_device_map({"a": 0}) == {"a": 0} and clean_device_map({}) == {}
