"""Big-model inference: empty init, load + dispatch over CPU/disk (and GPU when present), offload, hooks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from helpers import ROOT, SCRIPTS, requires
from torch import nn

from hasten.big_modeling import (
    cpu_offload,
    cpu_offload_with_hook,
    disk_offload,
    dispatch_model,
    get_state_dict_offloaded_model,
    init_empty_weights,
    init_on_device,
    load_checkpoint_and_dispatch,
)
from hasten.big_modeling.hook_attach import remove_hook_from_submodules
from hasten.big_modeling.hooks import (
    AlignDevicesHook,
    ModelHook,
    SequentialHook,
    add_hook_to_module,
    align_module_device,
    has_offloaded_params,
    remove_hook_from_module,
)
from hasten.big_modeling.modeling import find_tied_parameters, retie_parameters
from hasten.big_modeling.offload import (
    OffloadedWeightsLoader,
    load_offloaded_weight,
    load_offloaded_weights,
    offload_state_dict,
    offload_weight,
)
from hasten.big_modeling.serialization import save_model_weights
from hasten.big_modeling.tensors import set_module_tensor_to_device
from hasten.errors import CheckpointError, ConfigError, NotSupportedError

SCRIPT = SCRIPTS / "big_model_rss.py"


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)
        self.register_buffer("scale", torch.full((width,), 0.5))

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x))) * self.scale


class LM(nn.Module):
    def __init__(self, vocab: int = 64, width: int = 32, depth: int = 6):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("positions", torch.arange(16), persistent=False)

    def forward(self, ids):
        x = self.embed(ids) + self.positions[: ids.shape[1], None].float() / 100
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    torch.manual_seed(0)
    model = LM()
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        expected = model(ids)
    folder = tmp_path_factory.mktemp("ckpt")
    save_model_weights(model.state_dict(), folder, max_shard_size="20KB")
    assert len(list(folder.glob("model-*.safetensors"))) > 3
    return model, ids, expected, folder


def _empty() -> LM:
    with init_empty_weights():
        return LM()


def _assert_same(model, ids, expected):
    with torch.no_grad():
        torch.testing.assert_close(model(ids), expected, atol=1e-6, rtol=0)


# ------------------------------------------------------------------------------------- empty init


def test_init_empty_weights_patches_register_parameter_alone_and_restores_only_it():
    original_parameter, original_buffer = nn.Module.register_parameter, nn.Module.register_buffer
    with init_empty_weights(include_buffers=True):
        assert nn.Module.register_parameter is original_parameter  # nothing patched: meta is the default device
        assert nn.Linear(2, 2).weight.device.type == "meta"
    try:
        with init_empty_weights():
            assert nn.Module.register_parameter is not original_parameter
            assert nn.Module.register_buffer is original_buffer

            def replaced(module, *args, **kwargs):
                return original_buffer(module, *args, **kwargs)

            nn.Module.register_buffer = replaced  # another library's patch, made inside the context, is kept
        assert nn.Module.register_parameter is original_parameter and nn.Module.register_buffer is replaced
    finally:
        nn.Module.register_buffer = original_buffer


def test_init_empty_weights_holds_no_storage():
    model = _empty()
    assert all(p.device.type == "meta" for p in model.parameters())
    assert model.blocks[0].scale.device.type == "cpu" and torch.equal(model.positions, torch.arange(16))
    assert model.head.weight is model.embed.weight
    with init_empty_weights(include_buffers=True):
        everything = LM()
    assert all(t.device.type == "meta" for t in [*everything.parameters(), *everything.buffers()])
    assert nn.Module.register_parameter.__name__ == "register_parameter" and nn.Linear(2, 2).weight.device.type == "cpu"


def test_include_buffers_default_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("HASTEN_INIT_INCLUDE_BUFFERS", "1")
    with init_empty_weights():
        model = LM()
    assert model.blocks[0].scale.device.type == "meta"


def test_init_on_device_keeps_parameter_class_and_flags():
    class Tagged(nn.Parameter):
        pass

    with init_on_device("meta"):
        module = nn.Module()
        module.weight = Tagged(torch.ones(3), requires_grad=False)
    assert type(module.weight) is Tagged and module.weight.device.type == "meta" and not module.weight.requires_grad


@pytest.mark.serial
def test_multi_billion_parameter_model_builds_fast_without_memory():
    rss = psutil.Process().memory_info().rss
    start = time.perf_counter()
    with init_empty_weights():
        model = nn.Sequential(*[nn.Linear(8192, 8192) for _ in range(100)])  # 6.7e9 parameters, 27 GB in fp32
    elapsed = time.perf_counter() - start
    assert sum(p.numel() for p in model.parameters()) > 6_000_000_000
    assert elapsed < 1.0, elapsed
    assert psutil.Process().memory_info().rss - rss < 50 * 2**20


# --------------------------------------------------------------------------------- load + dispatch


CPU_DISK_MAP = {
    "embed": "cpu",
    "blocks.0": "cpu",
    "blocks.1": "disk",
    "blocks.2": "cpu",
    "blocks.3": "disk",
    "blocks.4": "disk",
    "blocks.5": "cpu",
    "norm": "disk",
    "head": "cpu",
}


def test_load_and_dispatch_on_cpu_and_disk_matches(reference, tmp_path):
    _, ids, expected, folder = reference
    model = load_checkpoint_and_dispatch(_empty(), folder, device_map=CPU_DISK_MAP, offload_folder=tmp_path)
    assert model.hf_device_map == CPU_DISK_MAP
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index.json"]  # safetensors weights are not copied
    index = json.loads((tmp_path / "index.json").read_text())
    assert Path(index["blocks.1.fc1.weight"]["safetensors_file"]).parent == folder
    assert model.blocks[1].fc1.weight.device.type == "meta" and model.blocks[0].fc1.weight.device.type == "cpu"
    _assert_same(model, ids, expected)
    assert model.blocks[1].fc1.weight.device.type == "meta"  # streamed in for the forward only
    _assert_same(model, ids, expected)


def test_auto_map_with_small_cpu_budget_uses_disk(reference, tmp_path):
    _, ids, expected, folder = reference
    model = _empty()
    with pytest.warns(UserWarning, match=r"do not match any submodules in the model: \['positions'\]"):  # as Accelerate
        model = load_checkpoint_and_dispatch(
            model,
            folder,
            device_map="auto",
            max_memory={"cpu": "60KB"},
            no_split_module_classes=["Block"],
            offload_folder=tmp_path,
        )
    assert "disk" in model.hf_device_map.values() and "cpu" in model.hf_device_map.values()
    assert not any(name.startswith("blocks.") and name.count(".") > 1 for name in model.hf_device_map)
    _assert_same(model, ids, expected)


def test_load_without_device_map_only_loads(reference):
    model, ids, expected, folder = reference
    loaded = load_checkpoint_and_dispatch(_empty(), folder)
    assert not hasattr(loaded, "hf_device_map") and not hasattr(loaded, "_hf_hook")
    _assert_same(loaded, ids, expected)


def test_unknown_device_map_strategy(reference):
    with pytest.raises(ConfigError, match="Unknown device_map 'balance'.*Did you mean 'balanced'"):
        load_checkpoint_and_dispatch(_empty(), reference[3], device_map="balance")


def test_dispatch_in_memory_model_writes_disk_weights(reference, tmp_path):
    model, ids, expected, _ = reference
    copy = LM()
    copy.load_state_dict(model.state_dict())
    dispatched = dispatch_model(
        copy, {"embed": "cpu", "blocks": "disk", "norm": "cpu", "head": "cpu"}, offload_dir=tmp_path
    )
    assert (tmp_path / "index.json").is_file() and (tmp_path / "blocks.2.fc2.weight.dat").is_file()
    assert dispatched.blocks[2].fc2.weight.device.type == "meta"
    _assert_same(dispatched, ids, expected)
    state = get_state_dict_offloaded_model(dispatched)
    for name, tensor in model.state_dict().items():
        assert torch.equal(state[name], tensor), name
    with pytest.raises(NotSupportedError, match="cannot move a dispatched model with offloaded weights"):
        dispatched.to("cpu")
    remove_hook_from_module(dispatched, recurse=True)
    assert "to" not in dispatched.__dict__ and dispatched.forward.__func__ is LM.forward


def test_force_hooks_on_one_device(reference):
    model, ids, expected, _ = reference
    copy = LM()
    copy.load_state_dict(model.state_dict())
    dispatched = dispatch_model(copy, {"": "cpu"}, force_hooks=True)
    assert isinstance(dispatched._hf_hook, AlignDevicesHook) and dispatched._hf_hook.io_same_device
    _assert_same(dispatched, ids, expected)
    with pytest.warns(UserWarning, match=r"model.to\(\) moves a model dispatched with a device_map"):
        dispatched.to("cpu")


def test_dispatch_errors(reference):
    with pytest.raises(ConfigError, match="offloads blocks to disk: pass offload_dir"):
        dispatch_model(LM(), {"embed": "cpu", "blocks": "disk", "norm": "cpu", "head": "cpu"})
    with pytest.raises(ConfigError, match="offloads the whole model to disk: pass offload_dir"):
        dispatch_model(LM(), {"": "disk"})
    with pytest.raises(ConfigError, match=r"no data \(meta device\): embed.weight"):
        dispatch_model(_empty(), {"": "cpu"})


def test_tensor_level_entries(tmp_path):
    class WithOwnParam(nn.Module):
        def __init__(self):
            super().__init__()
            self.bias = nn.Parameter(torch.randn(8))
            self.inner = nn.Linear(8, 8)

        def forward(self, x):
            return self.inner(x) + self.bias

    torch.manual_seed(1)
    model = WithOwnParam()
    x = torch.randn(3, 8)
    expected = model(x)
    save_model_weights(model.state_dict(), tmp_path / "ckpt")
    with init_empty_weights():
        empty = WithOwnParam()
    with pytest.warns(UserWarning, match=r"do not match any submodules in the model: \['bias'\]"):  # as Accelerate
        loaded = load_checkpoint_and_dispatch(
            empty, tmp_path / "ckpt", device_map={"bias": "disk", "inner": "cpu"}, offload_folder=tmp_path / "off"
        )
    # Accelerate's hooks leave 'bias' on the meta device here and its forward fails; hasten brings it in
    torch.testing.assert_close(loaded(x), expected, atol=1e-6, rtol=0)


@pytest.mark.cuda  # tests marked cuda need a CUDA device
def test_gpu_cpu_disk_map_matches(reference, tmp_path):
    _, ids, expected, folder = reference
    device_map = {**CPU_DISK_MAP, "embed": 0, "blocks.0": 0, "head": 0}
    model = load_checkpoint_and_dispatch(_empty(), folder, device_map=device_map, offload_folder=tmp_path)
    assert model.blocks[0].fc1.weight.device.type == "cuda" and model.blocks[2].fc1.weight.device.type == "meta"
    with torch.no_grad():
        output = model(ids)
    assert output.device.type == "cpu"
    torch.testing.assert_close(output, expected, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        on_gpu = model(ids.cuda())
    assert on_gpu.device.type == "cuda"


@pytest.mark.cuda  # tests marked cuda need a CUDA device
def test_auto_map_on_gpu(reference, tmp_path):
    _, ids, expected, folder = reference
    model = load_checkpoint_and_dispatch(
        _empty(),
        folder,
        device_map="auto",
        max_memory={0: "40KB", "cpu": "40KB"},
        no_split_module_classes=["Block"],
        offload_folder=tmp_path,
    )
    assert {0, "cpu", "disk"} <= set(model.hf_device_map.values())
    with torch.no_grad():
        torch.testing.assert_close(model(ids), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.cuda  # tests marked cuda need a CUDA device
def test_cpu_offload_with_hook_on_gpu(reference):
    ids = reference[1]
    first, hook_1 = cpu_offload_with_hook(nn.Sequential(nn.Embedding(64, 32)), "cuda:0")
    assert first[0].weight.device.type == "cpu"
    hidden = first(ids)
    assert first[0].weight.device.type == "cuda" and hidden.device.type == "cuda"
    second, hook_2 = cpu_offload_with_hook(nn.Linear(32, 4), "cuda:0", prev_module_hook=hook_1)
    second(hidden)
    assert first[0].weight.device.type == "cpu" and second.weight.device.type == "cuda"
    hook_2.offload()
    assert second.weight.device.type == "cpu"


# ------------------------------------------------------------------------------------------ offload


def test_cpu_offload_and_disk_offload_match(reference, tmp_path):
    model, ids, expected, _ = reference
    for build in (lambda m: cpu_offload(m), lambda m: disk_offload(m, tmp_path / "disk")):
        copy = LM()
        copy.load_state_dict(model.state_dict())
        offloaded = build(copy)
        assert has_offloaded_params(offloaded.blocks[0].fc1) and offloaded.blocks[0].fc1.weight.device.type == "meta"
        _assert_same(offloaded, ids, expected)
        with align_module_device(offloaded.blocks[0].fc1):
            assert torch.equal(offloaded.blocks[0].fc1.weight, model.blocks[0].fc1.weight)
        assert offloaded.blocks[0].fc1.weight.device.type == "meta"
        remove_hook_from_module(offloaded, recurse=True)
        assert torch.equal(offloaded.blocks[0].fc1.weight, model.blocks[0].fc1.weight)
        _assert_same(offloaded, ids, expected)
    assert (tmp_path / "disk" / "index.json").is_file()


def test_cpu_offload_with_hook_handle_on_cpu():
    model = nn.Linear(4, 4)
    model, hook = cpu_offload_with_hook(model, "cpu")
    assert isinstance(model._hf_hook, ModelHook)
    model(torch.ones(1, 4))
    hook.offload()
    hook.remove()
    assert not hasattr(model, "_hf_hook") and model.forward.__func__ is nn.Linear.forward


def test_offloaded_weights_loader_reads_accelerate_dat_files(tmp_path):
    weight = torch.randn(3, 5).to(torch.bfloat16)
    np.asarray(weight.view(torch.int16).numpy()).tofile(tmp_path / "w.dat")
    (tmp_path / "index.json").write_text(json.dumps({"w": {"dtype": "bfloat16", "shape": [3, 5]}}))
    loader = OffloadedWeightsLoader(save_folder=tmp_path)
    assert list(loader) == ["w"] and torch.equal(loader["w"], weight)


def test_offload_state_dict_round_trip(tmp_path):
    model = LM()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    index = offload_state_dict(tmp_path, model.state_dict())
    assert (
        index["head.weight"] == index["embed.weight"] == {"dtype": "float32", "shape": list(model.embed.weight.shape)}
    )
    fresh = _empty()
    load_offloaded_weights(fresh, index, tmp_path)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in expected.items())
    assert fresh.head.weight is fresh.embed.weight
    with pytest.raises(CheckpointError, match="offloaded weights file .* is missing"):
        (tmp_path / "norm.weight.dat").unlink()
        OffloadedWeightsLoader(save_folder=tmp_path)["norm.weight"]


def test_offload_folders_use_accelerates_dat_format(tmp_path):
    """What Accelerate's, diffusers' and peft's readers expect: index.json of {dtype, shape}, raw bytes in
    <name>.dat."""
    weights = {
        "w": torch.randn(3, 5),
        "half": torch.randn(4).to(torch.bfloat16),
        "fp8": torch.randn(2, 2).to(torch.float8_e4m3fn),
        "steps": torch.tensor(7),
        "empty": torch.zeros(0, 3),
    }
    offload_state_dict(tmp_path, weights)
    index = json.loads((tmp_path / "index.json").read_text())
    assert index == {
        "w": {"dtype": "float32", "shape": [3, 5]},
        "half": {"dtype": "bfloat16", "shape": [4]},
        "fp8": {"dtype": "float8_e4m3fn", "shape": [2, 2]},
        "steps": {"dtype": "int64", "shape": []},
        "empty": {"dtype": "float32", "shape": [0, 3]},
    }
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "empty.dat",
        "fp8.dat",
        "half.dat",
        "index.json",
        "steps.dat",
        "w.dat",
    ]
    assert np.array_equal(np.fromfile(tmp_path / "w.dat", dtype=np.float32).reshape(3, 5), weights["w"].numpy())
    assert np.array_equal(np.fromfile(tmp_path / "half.dat", dtype=np.int16), weights["half"].view(torch.int16).numpy())
    assert np.array_equal(
        np.fromfile(tmp_path / "fp8.dat", dtype=np.int8).reshape(2, 2), weights["fp8"].view(torch.int8).numpy()
    )
    assert np.fromfile(tmp_path / "steps.dat", dtype=np.int64).tolist() == [7]
    loader = OffloadedWeightsLoader(save_folder=tmp_path)
    for name, tensor in weights.items():
        assert loader[name].dtype == tensor.dtype and loader[name].shape == tensor.shape
        assert torch.equal(loader[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name
    single = offload_weight(weights["w"], "extra", tmp_path, {})
    assert single == {"extra": {"dtype": "float32", "shape": [3, 5]}} and torch.equal(
        load_offloaded_weight(tmp_path / "extra.dat", single["extra"]), weights["w"]
    )


def test_dispatch_model_with_everything_on_disk_offloads(reference, tmp_path):
    model, ids, expected, _ = reference
    copy = LM()
    copy.load_state_dict(model.state_dict())
    dispatched = dispatch_model(copy, {"": "disk"}, offload_dir=tmp_path)
    assert dispatched.hf_device_map == {"": "disk"} and dispatched.blocks[0].fc1.weight.device.type == "meta"
    assert (tmp_path / "index.json").is_file() and (tmp_path / "blocks.0.fc1.weight.dat").is_file()
    _assert_same(dispatched, ids, expected)


# -------------------------------------------------------------------------------------------- hooks


class _AddOne(ModelHook):
    def pre_forward(self, module, *args, **kwargs):
        return (args[0] + 1,), kwargs

    def post_forward(self, module, output):
        return output * 10


def test_add_and_remove_hooks():
    module = nn.Linear(2, 2, bias=False)
    nn.init.eye_(module.weight)
    x = torch.ones(1, 2)
    add_hook_to_module(module, _AddOne())
    assert torch.equal(module(x), torch.full((1, 2), 20.0))
    add_hook_to_module(module, _AddOne(), append=True)
    assert isinstance(module._hf_hook, SequentialHook)
    assert torch.equal(module(x), torch.full((1, 2), 300.0))
    add_hook_to_module(module, _AddOne())
    assert torch.equal(module(x), torch.full((1, 2), 20.0))
    remove_hook_from_module(module)
    assert (
        torch.equal(module(x), x)
        and module.forward.__func__ is nn.Linear.forward
        and not hasattr(module, "_old_forward")
    )

    parent = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2)))
    for child in parent.modules():
        add_hook_to_module(child, _AddOne())
    remove_hook_from_submodules(parent)  # the module itself too, as in Accelerate
    assert not any(hasattr(m, "_hf_hook") for m in parent.modules())


def test_no_grad_hook():
    class NoGrad(ModelHook):
        no_grad = True

    module = add_hook_to_module(nn.Linear(2, 2), NoGrad())
    assert not module(torch.ones(1, 2)).requires_grad


def test_offloading_hook_without_execution_device_fails_at_the_forward():
    module = add_hook_to_module(nn.Linear(2, 2), AlignDevicesHook(offload=True))
    assert has_offloaded_params(module) and module.weight.device.type == "meta"
    with pytest.raises(TypeError, match="on device None: pass a device"):
        module(torch.ones(1, 2))


def test_align_devices_hook_moves_inputs_and_outputs():
    module = nn.Linear(3, 3)
    hook = AlignDevicesHook(execution_device="cpu", io_same_device=True, skip_keys="keep")
    add_hook_to_module(module, hook)
    assert module(torch.ones(2, 3)).shape == (2, 3)
    assert "AlignDevicesHook(execution_device=cpu" in repr(hook)


# -------------------------------------------------------------------------------- tensor utilities


def test_set_module_tensor_to_device():
    with init_empty_weights():
        model = nn.Sequential(nn.Linear(2, 3))
    with pytest.raises(ConfigError, match="'0.weight' is on the meta device and has no data"):
        set_module_tensor_to_device(model, "0.weight", "cpu")
    with pytest.raises(ValueError) as shape_error:
        set_module_tensor_to_device(model, "0.weight", "cpu", value=torch.ones(2, 3))
    assert isinstance(shape_error.value, ConfigError) and str(shape_error.value) == (
        'Trying to set a tensor of shape torch.Size([2, 3]) in "weight" (which has shape torch.Size([3, 2])), '
        "this looks incorrect."
    ), "Accelerate's message, word for word (callers compare it)"
    with pytest.raises(AttributeError, match="has no submodule '1'"):  # Accelerate's type, hasten's message
        set_module_tensor_to_device(model, "1.weight", "cpu", value=torch.ones(3, 2))
    with pytest.raises(ConfigError, match="no parameter or buffer named 'wieght'.*Did you mean 'weight'"):
        set_module_tensor_to_device(model, "0.wieght", "cpu", value=torch.ones(3, 2))
    set_module_tensor_to_device(model, "0.weight", "cpu", value=torch.ones(3, 2, dtype=torch.float64))
    assert model[0].weight.dtype == torch.float32 and isinstance(model[0].weight, nn.Parameter)
    set_module_tensor_to_device(model, "0.bias", "cpu", value=torch.ones(3), dtype="bfloat16")
    assert model[0].bias.dtype == torch.bfloat16 and model[0].bias.requires_grad
    weight = model[0].weight
    set_module_tensor_to_device(model, "0.weight", "cpu")
    assert model[0].weight is weight  # already there: untouched


def test_find_and_retie_parameters():
    model = LM()
    assert find_tied_parameters(model) == [["embed.weight", "head.weight"]]
    model.head.weight = nn.Parameter(torch.zeros_like(model.embed.weight))
    assert find_tied_parameters(model) == []
    retie_parameters(model, [["embed.weight", "head.weight"]])
    assert model.head.weight is model.embed.weight


# ------------------------------------------------------------------------------------- peak memory


@pytest.mark.slow
def test_disk_offloaded_run_stays_within_budget(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    subprocess.run(
        [sys.executable, str(SCRIPT), "save", str(tmp_path), "--blocks", "16", "--width", "1024"], check=True, env=env
    )
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "run", str(tmp_path), "--budget-mb", "32"],
        check=True,
        env=env,
        capture_output=True,
        text=True,
    )
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["weights_mb"] >= 4 * report["budget_mb"]
    assert report["blocks_on_disk"] > report["blocks_on_cpu"] > 0
    assert report["offload_folder_files"] == ["index.json"]
    assert report["max_abs_diff"] == 0.0
    assert report["peak_over_baseline_mb"] < report["limit_mb"], report


@pytest.mark.slow
@requires("transformers")
def test_transformers_from_pretrained_device_map_auto_offloads_to_disk(tmp_path):
    script = SCRIPTS / "transformers_disk_offload.py"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["devices"] == ["cpu", "disk"] and report["disk_entries"] > 0 and report["same_logits"], report


def test_sequence_parallelism_check_refuses_linear_attention_layers_only():
    from types import SimpleNamespace

    from hasten.big_modeling import _refuse_recurrent_layers_under_sequence_parallelism as refuse

    def model(layer_types):
        config = SimpleNamespace(layer_types=layer_types)
        config.get_text_config = lambda: config
        return SimpleNamespace(config=config)

    with pytest.raises(ValueError, match=r"\['linear_attention'\].*sp_size=1"):
        refuse(model(["full_attention", "linear_attention", "full_attention"]))
    refuse(model(["full_attention", "sliding_attention"]))
    refuse(model(None))
    refuse(SimpleNamespace())
