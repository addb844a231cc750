"""Accelerate's module layout under hasten, and the small names libraries import from it, doing what they say."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from helpers import ROOT, clean_env, free_port, requires
from torch import nn

import hasten.errors
import hasten.utils
from hasten.errors import NotSupportedError


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block.proj(h)
        return self.head(h)


def test_submodule_paths_give_the_objects_of_the_flat_namespace():
    from hasten.utils import _layout

    for submodule, table in _layout.LAYOUT.items():
        module = importlib.import_module(f"hasten.utils.{submodule}")
        assert sorted(module.__all__) == sorted(table)
        for name in table:
            assert getattr(module, name) is getattr(hasten.utils, name), f"hasten.utils.{submodule}.{name}"


def test_utils_tqdm_stays_the_function_after_its_submodule_is_imported():
    import hasten.utils.tqdm  # noqa: F401 (the import must not rebind the package attribute)

    assert callable(hasten.utils.tqdm) and not isinstance(hasten.utils.tqdm, type(hasten))
    assert hasten.utils.modeling is sys.modules["hasten.utils.modeling"]


def test_fsdp_constants_are_the_option_lists_of_the_config_file():
    from hasten.config import FSDP_AUTO_WRAP_POLICIES, FSDP_SHARDING_STRATEGIES
    from hasten.utils.constants import FSDP_AUTO_WRAP_POLICY, FSDP_SHARDING_STRATEGY, SAFE_WEIGHTS_NAME

    assert FSDP_SHARDING_STRATEGY == ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"]
    assert FSDP_AUTO_WRAP_POLICY == ["TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"]
    assert FSDP_SHARDING_STRATEGY == list(FSDP_SHARDING_STRATEGIES) and FSDP_AUTO_WRAP_POLICY == list(
        FSDP_AUTO_WRAP_POLICIES
    )
    assert SAFE_WEIGHTS_NAME == "model.safetensors"


def test_get_module_class_from_name_finds_nested_classes():
    from hasten.utils.dataclasses import get_module_class_from_name

    model = Net()
    assert get_module_class_from_name(model, "Block") is Block
    assert get_module_class_from_name(model, "Net") is Net
    assert get_module_class_from_name(model, "Linear") is nn.Linear
    assert get_module_class_from_name(model, "Conv2d") is None


def test_default_config_file_and_load_config_from_file(tmp_path):
    from hasten.commands.config import default_config_file, load_config_from_file
    from hasten.utils import write_basic_config

    assert default_config_file.endswith("default_config.yaml")
    path = tmp_path / "cfg.yaml"
    write_basic_config(mixed_precision="bf16", save_location=str(path))
    loaded = load_config_from_file(str(path))
    assert loaded.mixed_precision == "bf16"
    assert loaded.to_dict()["mixed_precision"] == "bf16"


def test_purge_accelerate_environment_removes_what_the_function_set(monkeypatch):
    from hasten.utils import purge_accelerate_environment

    monkeypatch.setenv("ACCELERATE_KEEP", "before")

    @purge_accelerate_environment
    def sets_variables():
        os.environ["ACCELERATE_MIXED_PRECISION"] = "fp16"
        os.environ["HASTEN_DEBUG_MODE"] = "1"
        os.environ["ACCELERATE_KEEP"] = "changed"
        return "result"

    assert sets_variables() == "result"
    assert "ACCELERATE_MIXED_PRECISION" not in os.environ and "HASTEN_DEBUG_MODE" not in os.environ
    assert os.environ["ACCELERATE_KEEP"] == "before"

    @purge_accelerate_environment
    class Case:
        def test_one(self):
            os.environ["ACCELERATE_USE_CPU"] = "true"

    class Child(Case):
        def test_two(self):
            os.environ["HASTEN_USE_CPU"] = "true"

    Case().test_one()
    Child().test_two()
    assert "ACCELERATE_USE_CPU" not in os.environ and "HASTEN_USE_CPU" not in os.environ


def test_launch_command_parser_standalone_and_as_subcommand():
    from hasten.commands.launch import launch_command, launch_command_parser

    args = launch_command_parser().parse_args(["--num_processes", "2", "train.py", "--lr", "1e-3"])
    assert (str(args.num_processes), args.training_script, args.training_script_args) == (
        "2",
        "train.py",
        ["--lr", "1e-3"],
    )
    root = argparse.ArgumentParser()
    sub = launch_command_parser(root.add_subparsers())
    assert sub.prog.endswith("launch")
    assert root.parse_args(["launch", "x.py"]).func is launch_command


def test_prepare_multi_gpu_env_gives_the_process_environment(tmp_path):
    from hasten.commands.launch import launch_command_parser
    from hasten.utils.launch import prepare_multi_gpu_env, prepare_simple_launcher_cmd_env

    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    argv = [
        "--cpu",
        "--num_processes",
        "2",
        "--mixed_precision",
        "bf16",
        "--main_process_port",
        str(free_port()),
        str(script),
    ]
    args = launch_command_parser().parse_args(argv)
    env = prepare_multi_gpu_env(args)
    assert env["HASTEN_MIXED_PRECISION"] == "bf16" and env["HASTEN_LAUNCHED"] == "1"
    assert args.nproc_per_node == "2" and args.nnodes == "1" and args.node_rank == 0
    assert env["PATH"] == os.environ["PATH"]
    command, simple_env = prepare_simple_launcher_cmd_env(launch_command_parser().parse_args(["--cpu", str(script)]))
    assert command[-1] == str(script) and simple_env["HASTEN_USE_CPU"] in ("1", "true", "True")


def test_prepare_multi_gpu_env_refuses_a_missing_script():
    from hasten.commands.launch import launch_command_parser
    from hasten.errors import HastenError
    from hasten.utils.launch import prepare_multi_gpu_env

    with pytest.raises(HastenError, match="no_such_script.py"):
        prepare_multi_gpu_env(
            launch_command_parser().parse_args(["--cpu", "--num_processes", "2", "no_such_script.py"])
        )


def test_prepare_multi_gpu_env_takes_a_partial_namespace_written_for_accelerate():
    import argparse

    from hasten.utils.launch import prepare_multi_gpu_env

    # what a library builds by hand: no config_file, no script, switches left out as False, gpu_ids "all", port 0
    args = argparse.Namespace(
        num_processes=1,
        num_machines=1,
        machine_rank=0,
        main_process_ip="127.0.0.1",
        main_process_port=0,
        gpu_ids="all",
        mixed_precision="no",
        use_fsdp=False,
        use_megatron_lm=False,
        module=False,
        no_python=False,
    )
    prepare_multi_gpu_env(args)
    assert args.master_port.isdigit() and args.master_port != "0", "port 0 picks a free port, as in Accelerate"
    assert args.nproc_per_node == "1" and args.nnodes == "1"


def test_is_peft_model_without_and_with_peft_imported(monkeypatch):
    from hasten.utils import is_peft_model

    monkeypatch.delitem(sys.modules, "peft", raising=False)
    assert is_peft_model(Net()) is False

    class PeftModel(nn.Module):
        pass

    fake_peft = type(sys)("peft")
    fake_peft.PeftModel = PeftModel
    monkeypatch.setitem(sys.modules, "peft", fake_peft)
    assert is_peft_model(PeftModel()) is True
    assert is_peft_model(Net()) is False


def test_get_parameters_from_modules_by_list_regex_and_none():
    from hasten.utils.fsdp_utils import get_parameters_from_modules

    model = Net()
    assert get_parameters_from_modules(None, model, "cpu") == set()
    by_list = get_parameters_from_modules([model.head], model, "cpu")
    assert by_list == {model.head.weight, model.head.bias}
    by_regex = get_parameters_from_modules(r"blocks\.\d+\.proj", model, "cpu")
    assert by_regex == {p for block in model.blocks for p in block.proj.parameters()}


def test_availability_probes_with_accelerate_signatures():
    from hasten.utils import is_mps_available, is_schedulefree_available, is_xpu_available
    from hasten.utils.imports import is_npu_available, is_numpy_available

    assert is_schedulefree_available() is (importlib.util.find_spec("schedulefree") is not None)
    assert is_mps_available(min_version="1.12") == (torch.backends.mps.is_available())
    assert is_mps_available(min_version="999.0") is False
    assert is_xpu_available(check_device=True) is is_xpu_available()
    assert is_npu_available(check_device=True) is False
    assert is_numpy_available() is True and is_numpy_available(min_version="999") is False


def test_megatron_dummy_scheduler_holds_its_settings_and_the_rest_refuses():
    from hasten.utils import MegatronLMDummyScheduler
    from hasten.utils.dataclasses import MODEL_CONFIGS_TO_MEGATRON_PARSERS, MegatronLMPlugin
    from hasten.utils.megatron_lm import initialize

    optimizer = torch.optim.SGD(Net().parameters(), lr=0.1)
    scheduler = MegatronLMDummyScheduler(optimizer, total_num_steps=100, warmup_num_steps=10, decay_style="cosine")
    assert (scheduler.optimizer, scheduler.total_num_steps, scheduler.warmup_num_steps) == (optimizer, 100, 10)
    assert scheduler.kwargs == {"decay_style": "cosine"}
    assert set(MODEL_CONFIGS_TO_MEGATRON_PARSERS) == {"megatron-bert", "gpt2", "t5", "llama", "glm4_moe"}
    with pytest.raises(NotSupportedError, match="Megatron-LM"):
        MegatronLMPlugin(tp_degree=2)
    with pytest.raises(NotSupportedError, match="Megatron-LM"):
        initialize(None)


def test_str_to_bool_to_bool():
    from hasten.utils import str_to_bool

    assert (
        str_to_bool("yes") == 1 and str_to_bool("yes", to_bool=True) is True and str_to_bool("0", to_bool=True) is False
    )


def test_layerwise_casting_stores_low_and_computes_high():
    from hasten.big_modeling import attach_layerwise_casting_hooks

    torch.manual_seed(0)
    model = Net()
    x = torch.tensor([[1, 2, 3]])
    attach_layerwise_casting_hooks(model, torch.bfloat16, torch.float32, skip_modules_pattern=r"^head$")
    assert model.blocks[0].proj.weight.dtype == torch.bfloat16 and model.head.weight.dtype == torch.float32
    reference = Net()
    reference.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    assert torch.equal(model(x), reference(x))
    assert model.blocks[1].proj.weight.dtype == torch.bfloat16


def test_non_persistent_buffers_names_with_and_without_fqns():
    from hasten.utils.modeling import get_non_persistent_buffers

    model = Net()
    model.blocks[0].register_buffer("scratch", torch.zeros(1), persistent=False)
    assert get_non_persistent_buffers(model, recurse=True) == {"scratch"}
    assert get_non_persistent_buffers(model, recurse=True, fqns=True) == {"blocks.0.scratch"}


def test_operation_helpers_on_one_process():
    from hasten.errors import DistributedOperationException
    from hasten.utils.operations import (
        GatheredParameters,
        chained_operation,
        copy_tensor_to_devices,
        gather_tensor_shape,
    )

    tensor = torch.arange(6.0).reshape(2, 3)
    assert gather_tensor_shape(tensor) == (torch.Size([2, 3]), torch.float32)
    assert copy_tensor_to_devices(tensor) is tensor
    with GatheredParameters(Net().parameters(), modifier_rank=0):
        pass

    @chained_operation
    def failing():
        raise DistributedOperationException("shapes differ")

    with pytest.raises(DistributedOperationException, match="test_utils_layout.failing.*shapes differ"):
        failing()


def test_model_inspection_helpers():
    from hasten.utils import clean_state_dict_for_safetensors, get_module_children_bottom_up, has_repeated_blocks
    from hasten.utils.modeling import calculate_maximum_sizes, check_device_same

    model = Net()
    order = get_module_children_bottom_up(model, return_fqns=True)
    names = [name for name, _ in order]
    assert names[-1] == "" and names.index("blocks.0.proj") < names.index("blocks.0") < names.index("blocks")
    assert has_repeated_blocks(model) and not has_repeated_blocks(model.head)
    total, (largest, _) = calculate_maximum_sizes(model)
    assert total == sum(p.numel() * 4 for p in model.parameters()) and largest == 10 * 4 * 4  # the embedding
    assert check_device_same("cpu", torch.device("cpu")) and not check_device_same("cpu", "meta")
    shared = torch.zeros(3)
    cleaned = clean_state_dict_for_safetensors({"a": shared, "b": shared, "c": torch.ones(2).t()})
    assert list(cleaned) == ["a", "c"]


def test_patch_optimizer_step_records_the_call():
    from hasten.optimizer import patch_optimizer_step

    calls = []
    holder = type("Holder", (), {})()
    step = patch_optimizer_step(holder, lambda *a: calls.append(a) or "stepped")
    assert step(1) == "stepped" and calls == [(1,)] and holder._accelerate_step_called is True


def test_env_var_path_add(monkeypatch):
    from hasten.utils.launch import env_var_path_add

    monkeypatch.setenv("SOME_PATH", f"/a{os.pathsep}/b")
    assert env_var_path_add("SOME_PATH", "/c") == os.pathsep.join(["/a", "/b", "/c"])
    monkeypatch.delenv("SOME_PATH")
    assert env_var_path_add("SOME_PATH", "/c") == "/c"


def test_numpy_arrays_load_without_running_pickled_code(tmp_path):
    from hasten.utils import load, save

    path = tmp_path / "rng.bin"
    state = {"numpy": np.random.RandomState(0).get_state()[1], "step": 3}
    save(state, path)
    loaded = load(path)
    assert loaded["step"] == 3 and np.array_equal(loaded["numpy"], state["numpy"])


def test_memory_utils_is_the_old_path_and_warns():
    sys.modules.pop("hasten.memory_utils", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module("hasten.memory_utils")
    assert any(issubclass(w.category, FutureWarning) for w in caught)
    assert module.find_executable_batch_size is hasten.utils.find_executable_batch_size
    from hasten.parallelism_config import ParallelismConfig

    assert ParallelismConfig is hasten.utils.ParallelismConfig


def test_importing_every_utils_submodule_stays_cheap():
    code = (
        "import sys, importlib\n"
        "from hasten.utils import _layout\n"
        "for name in _layout.LAYOUT: importlib.import_module('hasten.utils.' + name)\n"
        "print(sorted(m for m in ('torch', 'deepspeed', 'transformers', 'peft', 'numpy') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=clean_env(PYTHONPATH=str(ROOT / "src")),
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "[]"


def test_hf_deepspeed_config_navigation_as_transformers_uses_it():
    from hasten.utils.deepspeed import HfDeepSpeedConfig

    config = HfDeepSpeedConfig._unregistered(
        {
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
            "optimizer": {"params": {"lr": "auto"}},
        }
    )
    assert config.is_zero2() and not config.is_zero3() and (config._stage, config._offload) == (2, True)
    node, key = config.find_config_node("optimizer.params.lr")
    node[key] = 0.1  # what transformers' fill_match does
    assert config.get_value("optimizer.params.lr") == 0.1
    assert config.find_config_node("scheduler.params.warmup") == (None, "warmup")
    config.del_config_sub_tree("optimizer")
    assert "optimizer" not in config.config
    config.del_config_sub_tree("scheduler.params")
    with pytest.raises(hasten.errors.ConfigError, match="scheduler"):
        config.del_config_sub_tree("scheduler", must_exist=True)


def test_ddp_kwargs_to_dict_leaves_out_the_hook_settings():
    from hasten.utils import DistributedDataParallelKwargs

    handler = DistributedDataParallelKwargs(find_unused_parameters=True)
    assert "comm_hook" not in handler.to_dict() and handler.to_dict()["find_unused_parameters"] is True
    assert "comm_hook" in handler.to_dict(ignore_keys=())
    assert handler.to_kwargs() == {"find_unused_parameters": True}


@requires("deepspeed")
def test_accelerator_state_names_its_deepspeed_plugins():
    from hasten.state import AcceleratorState
    from hasten.utils import DeepSpeedPlugin

    first, second = DeepSpeedPlugin(zero_stage=2), DeepSpeedPlugin(zero_stage=3)
    state = AcceleratorState(cpu=True, deepspeed_plugin={"student": first, "teacher": second})
    assert state.get_deepspeed_plugin("teacher") is second
    with pytest.raises(hasten.errors.ConfigError, match="'teacher', .*'student'|'student', 'teacher'"):
        state.get_deepspeed_plugin("critic")
    state.select_deepspeed_plugin("student")
    assert first.selected


def test_parallelism_config_mesh_and_json():
    import json

    from hasten.parallelism_config import ParallelismConfig

    config = ParallelismConfig(dp_shard_size=1)
    assert json.loads(config.to_json())["dp_shard_size"] == 1
    with pytest.raises(hasten.errors.ConfigError, match="device_type"):
        config.get_device_mesh()


@requires("deepspeed")
@requires("transformers")
def test_set_deepspeed_weakref_points_transformers_at_the_zero3_config():
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled, unset_hf_deepspeed_config

    from hasten.utils import DeepSpeedPlugin

    plugin = DeepSpeedPlugin(zero_stage=3, zero3_init_flag=True)
    try:
        plugin.set_deepspeed_weakref()
        assert is_deepspeed_zero3_enabled()
    finally:
        unset_hf_deepspeed_config()


def test_fp8_layer_filters_and_layer_probes():
    from hasten.utils.ao import filter_linear_layers, find_first_last_linear_layers, has_ao_layers
    from hasten.utils.bnb import has_4bit_bnb_layers, load_and_quantize_model

    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Linear(32, 8))
    assert find_first_last_linear_layers(model) == ("0", "3")
    assert filter_linear_layers(model[2], "2", ["0", "3"]) is True
    assert filter_linear_layers(model[0], "0", ["0", "3"]) is False
    assert filter_linear_layers(model[3], "x", []) is False  # 8 output features: not a multiple of 16
    assert has_ao_layers(model) is False and has_4bit_bnb_layers(model) is False
    with pytest.raises(NotSupportedError, match="bitsandbytes"):
        load_and_quantize_model(model, None)


def test_prepare_for_launch_sets_the_rank_then_runs(monkeypatch):
    from hasten.utils import PrepareForLaunch

    seen = []
    monkeypatch.setenv("NPROC", "2")
    monkeypatch.setenv("NODE_RANK", "1")
    for key in ("LOCAL_RANK", "RANK", "FORK_LAUNCHED"):
        monkeypatch.delenv(key, raising=False)
    PrepareForLaunch(
        lambda x: seen.append((x, os.environ["LOCAL_RANK"], os.environ["RANK"])), distributed_type="MULTI_CPU"
    )(1, "arg")
    assert seen == [("arg", "1", "3")]


def test_environment_and_machine_helpers(monkeypatch, caplog):
    from hasten.utils.environment import (
        are_libraries_initialized,
        check_cuda_p2p_ib_support,
        convert_dict_to_env_variables,
        get_cpu_distributed_information,
        get_current_device_type,
    )

    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    info = get_cpu_distributed_information()
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (3, 4, 1, 2)
    assert are_libraries_initialized("torch", "surely_not_a_module") == ["torch"]
    from hasten.accelerate_alias import logger_for

    name = logger_for("utils.environment").name  # accelerate.utils.environment once a test here installed the alias
    with caplog.at_level("WARNING", logger=name):
        assert convert_dict_to_env_variables({"GOOD": "1", "BAD": "a b", "EMPTY": ""}) == ["GOOD=1\n"]
    assert [("BAD" in r.msg or "EMPTY" in r.msg, r.name) for r in caplog.records] == [(True, name)] * 2
    assert get_current_device_type() in (("cuda", "MULTI_GPU"), ("xpu", "MULTI_XPU"))
    assert isinstance(check_cuda_p2p_ib_support(), bool)


def test_mixed_precision_context_and_grad_scaler():
    from hasten.accelerator import Accelerator
    from hasten.utils.modeling import get_grad_scaler, get_mixed_precision_context_manager

    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    with get_mixed_precision_context_manager(native_amp=True):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    with get_mixed_precision_context_manager(native_amp=False):
        assert not torch.is_autocast_enabled("cpu")
    assert isinstance(get_grad_scaler(accelerator.distributed_type, init_scale=8.0), torch.amp.GradScaler)
    assert get_grad_scaler(init_scale=8.0).get_scale() == 8.0
