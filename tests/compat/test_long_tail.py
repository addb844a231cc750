"""Accelerate's smaller utilities that hasten keeps as Accelerate has them: kwargs handlers' dictionaries,
``BnbQuantizationConfig``, ``save``'s shared-tensor log and ``load``'s refusal of pickles."""

import datetime
import logging
import pickle

import pytest
import torch

from hasten.utils import (
    BnbQuantizationConfig,
    DistributedDataParallelKwargs,
    InitProcessGroupKwargs,
    ProfileKwargs,
    load,
    save,
)


def test_kwargs_handlers_give_a_copy_and_only_the_changed_fields():
    handler = DistributedDataParallelKwargs(comm_state_option={"rank": 2}, bucket_cap_mb=50)
    assert handler.to_kwargs() == {"bucket_cap_mb": 50}, "comm_* fields are not DDP's arguments"
    profile = ProfileKwargs(schedule_option={"wait": 1})
    profile.to_dict()["schedule_option"]["wait"] = 5
    assert profile.schedule_option == {"wait": 1}, "to_dict() is a deep copy, as in Accelerate"


def test_init_process_group_kwargs_fill_the_backends_timeout_as_accelerate():
    assert InitProcessGroupKwargs().timeout == datetime.timedelta(minutes=10)
    assert InitProcessGroupKwargs().to_kwargs() == {}
    gloo = InitProcessGroupKwargs(backend="gloo")
    assert gloo.to_kwargs() == {"backend": "gloo", "timeout": datetime.timedelta(minutes=30)}
    assert InitProcessGroupKwargs(timeout=90).timeout == datetime.timedelta(seconds=90)


def test_bnb_quantization_config_is_built_and_checked():
    four = BnbQuantizationConfig(load_in_4bit=True, bnb_4bit_compute_dtype="bf16")
    assert four.bnb_4bit_compute_dtype == torch.bfloat16 and four.torch_dtype == torch.bfloat16
    assert BnbQuantizationConfig(load_in_8bit=True).torch_dtype == torch.float16
    with pytest.raises(ValueError, match="exactly one of load_in_8bit and load_in_4bit"):
        BnbQuantizationConfig(load_in_8bit=True, load_in_4bit=True)
    with pytest.raises(ValueError, match="exactly one"):
        BnbQuantizationConfig()
    with pytest.raises(ValueError, match="bnb_4bit_quant_type"):
        BnbQuantizationConfig(load_in_4bit=True, bnb_4bit_quant_type="int3")


def test_save_logs_shared_tensors_and_keeps_the_callers_dict(tmp_path, caplog):
    linear = torch.nn.Linear(3, 3)
    state = {"a.weight": linear.weight, "b.weight": linear.weight}
    with caplog.at_level(logging.WARNING):
        save(state, tmp_path / "model.safetensors", safe_serialization=True)
    assert any("Removed shared tensor" in record.getMessage() for record in caplog.records)
    assert set(state) == {"a.weight", "b.weight"}
    back = load(tmp_path / "model.safetensors")
    assert back["a.weight"].data_ptr() == back["b.weight"].data_ptr()


def test_load_refuses_pickled_objects_with_an_unpickling_error(tmp_path):
    torch.save({"config": datetime.date(2024, 1, 1)}, tmp_path / "state.bin")
    with pytest.raises(pickle.UnpicklingError, match="Refused to load"):
        load(tmp_path / "state.bin")


def test_get_module_size_with_ties_counts_each_tied_module_once():
    from torch import nn

    from hasten.utils import compute_module_sizes, get_module_size_with_ties

    layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(12)])
    for index in range(1, 12):
        layers[index].weight = layers[0].weight
    sizes = compute_module_sizes(layers)
    treat = list(layers.named_children())[1:]
    tied = sorted(f"{i}.weight" for i in range(1, 12))  # "10" and "11" sort before "2": prefixes must end at a dot
    size, names, modules = get_module_size_with_ties(tied, sizes["0"], sizes, treat)
    assert size == sizes["0"] + 11 * sizes["0.bias"]
    assert names == [name.split(".")[0] for name in tied] and modules == [layers[int(n)] for n in names]
    assert get_module_size_with_ties([], 7, sizes, treat) == (7, [], [])
    with pytest.raises(ValueError, match="under none of the modules"):
        get_module_size_with_ties(["0.weight"], 7, sizes, treat)
