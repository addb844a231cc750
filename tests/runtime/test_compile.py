"""torch.compile: ``TorchDynamoPlugin`` settings, regional compilation, unwrapping compiled models, and a
model compiled by ``Accelerator(dynamo_backend=...)`` that trains, saves and reloads with clean names."""

import sys
from types import MethodType

import pytest
import torch
from helpers import SCRIPTS
from safetensors.torch import load_file

from hasten import Accelerator
from hasten.enums import DynamoBackend
from hasten.errors import ConfigError
from hasten.plugins.dynamo import TorchDynamoPlugin, build_dynamo_plugin
from hasten.runtime.compilation import (
    compile_model,
    compile_regions,
    compile_regions_deepspeed,
    compile_regions_fsdp2,
    compile_regions_in_place,
    has_repeated_blocks,
    is_repeated_blocks,
)
from hasten.runtime.wrappers import extract_model_from_parallel, has_compiled_regions, is_compiled_module

sys.path.insert(0, str(SCRIPTS))
from fsdp_model import batches, loss_fn, make_model  # noqa: E402

# ----------------------------------------------------------------------------------- the plugin


def test_plugin_defaults_and_environment(monkeypatch):
    plugin = TorchDynamoPlugin()
    assert (plugin.backend, plugin.mode, plugin.fullgraph, plugin.dynamic, plugin.use_regional_compilation) == (
        DynamoBackend.NO,
        "default",
        False,
        None,
        False,
    )
    assert not plugin.enabled and plugin.to_kwargs() == {}
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "inductor")
    monkeypatch.setenv("HASTEN_DYNAMO_MODE", "max-autotune")
    monkeypatch.setenv("HASTEN_DYNAMO_USE_FULLGRAPH", "true")
    monkeypatch.setenv("HASTEN_DYNAMO_USE_DYNAMIC", "false")
    monkeypatch.setenv("HASTEN_DYNAMO_USE_REGIONAL_COMPILATION", "1")
    plugin = TorchDynamoPlugin()
    assert plugin.enabled and plugin.backend == DynamoBackend.INDUCTOR and plugin.use_regional_compilation
    assert plugin.compile_kwargs() == {
        "backend": "inductor",
        "mode": "max-autotune",
        "fullgraph": True,
        "dynamic": False,
    }
    assert plugin.to_kwargs() == {  # torch.compile's arguments, as Accelerate's: no use_regional_compilation
        "backend": "inductor",
        "mode": "max-autotune",
        "fullgraph": True,
        "dynamic": False,
    }
    assert TorchDynamoPlugin(backend="eager", disable=True).enabled is False


def test_plugin_errors_name_the_setting():
    with pytest.raises(
        ConfigError, match="backend='inductr' is not a known torch.compile backend.*Did you mean 'inductor'"
    ):
        TorchDynamoPlugin(backend="inductr")
    with pytest.raises(ConfigError, match="mode='max_autotune'.*Did you mean 'max-autotune'"):
        TorchDynamoPlugin(backend="eager", mode="max_autotune")
    with pytest.raises(ConfigError, match="either a mode or options"):
        TorchDynamoPlugin(backend="inductor", mode="reduce-overhead", options={"trace.enabled": True})
    assert TorchDynamoPlugin(backend="inductor", options={"trace.enabled": False}).compile_kwargs()["options"] == {
        "trace.enabled": False
    }
    with pytest.raises(ConfigError, match="either dynamo_backend or dynamo_plugin, not both"):
        build_dynamo_plugin("eager", TorchDynamoPlugin())
    assert build_dynamo_plugin("EAGER").backend == DynamoBackend.EAGER
    with pytest.raises(ConfigError, match="is not available in this torch build"):
        compile_model(make_model(), TorchDynamoPlugin(backend="tensorrt"))


# ----------------------------------------------------------------------------------- unwrapping


def test_compiled_models_unwrap_to_the_original():
    model = make_model()
    compiled = torch.compile(model, backend="eager")
    assert extract_model_from_parallel(compiled) is compiled
    assert extract_model_from_parallel(compiled, keep_torch_compile=False) is model
    outer = torch.compile(torch.nn.DataParallel(model), backend="eager")
    view = extract_model_from_parallel(outer)
    assert is_compiled_module(view) and view._orig_mod is model and extract_model_from_parallel(outer) is view
    assert isinstance(outer._orig_mod, torch.nn.DataParallel), "the training wrapper is left untouched"
    assert list(extract_model_from_parallel(outer, keep_torch_compile=False).state_dict()) == list(model.state_dict())


def _graphs_of_one_step(model) -> int:
    """Unique graphs dynamo makes for one forward and backward of ``model`` (caches and counters reset first)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    loss_fn(model, batches(1)[0]).backward()
    return counters["stats"]["unique_graphs"]


def test_regional_compilation_compiles_blocks_and_the_other_parts_in_place():
    """As Accelerate's regions: each block, and embedding, norm and head whole; in place, names kept. Before, only the
    blocks were compiled (1 graph instead of 4)."""
    model = make_model()
    names = list(model.state_dict())
    assert compile_model(model, TorchDynamoPlugin(backend="eager", use_regional_compilation=True)) is model
    compiled = [name for name, m in model.named_modules() if m._compiled_call_impl is not None]
    assert compiled == ["embed", "layers.0", "layers.1", "norm", "head"] and has_compiled_regions(model)
    assert list(model.state_dict()) == names, "in-place compilation keeps parameter names"
    assert _graphs_of_one_step(model) == 4, "Embedding, Block (shared by both layers), LayerNorm, Linear"
    tokens = batches(1)[0]
    assert torch.allclose(loss_fn(model, tokens), loss_fn(make_model(), tokens))
    flat = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    compile_regions_in_place(flat, backend="eager")
    assert flat._compiled_call_impl is not None, "without repeated blocks the whole model is compiled in place"
    assert compile_model(model, TorchDynamoPlugin(backend="eager")) is model, (
        "a model with compiled regions is not compiled again"
    )


def test_in_place_helpers_of_fsdp2_and_deepspeed_are_accelerates():
    """The same regions with nn.Module.compile alone, which dynamo does not trace for torch's own modules (so these
    run eagerly, as under Accelerate); compile_regions_fsdp2 returns the module, compile_regions_deepspeed None."""
    model = make_model()
    assert compile_regions_fsdp2(model, backend="eager") is model
    compiled = [name for name, m in model.named_modules() if m._compiled_call_impl is not None]
    assert compiled == ["embed", "layers.0", "layers.1", "norm", "head"]
    assert _graphs_of_one_step(model) == 1, "only the blocks' graph"
    other = make_model()
    assert compile_regions_deepspeed(other, backend="eager") is None
    assert [name for name, m in other.named_modules() if m._compiled_call_impl is not None] == compiled


def test_repeated_blocks_and_compiled_regions_are_recognised_as_accelerate_does():
    block = torch.nn.Linear(2, 2)
    assert is_repeated_blocks(torch.nn.ModuleList([block]))
    assert not is_repeated_blocks(torch.nn.ModuleList())
    subclass_after = torch.nn.ModuleList([torch.nn.Module(), torch.nn.Linear(2, 2)])
    subclass_first = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Module()])
    assert is_repeated_blocks(subclass_after) and not is_repeated_blocks(subclass_first)
    assert has_repeated_blocks(torch.nn.Sequential(torch.nn.ModuleList([block])))
    assert not has_repeated_blocks(torch.nn.Sequential(torch.nn.ModuleList()))
    assert has_compiled_regions(torch.compile(torch.nn.Linear(2, 2))), "the wrapper itself counts, as in Accelerate"
    assert not has_compiled_regions(torch.nn.Linear(2, 2))


class _Tagged(torch.nn.Module):
    """Blocks in a list and a plain head; forward records which object ran and what its first block is."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])
        self.head = torch.nn.Linear(4, 2)
        self.tag = "original"

    def forward(self, x):
        self.seen = (self.tag, type(self.blocks[0]).__name__)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_compile_regions_returns_a_compiled_twin_and_leaves_the_model_alone():
    """As Accelerate's: a new object sharing the parameters, blocks wrapped by torch.compile, bound methods rebound."""
    model = _Tagged()
    model.forward = MethodType(lambda self, x: type(self).forward(self, x), model)
    twin = compile_regions(model, backend="eager")
    twin.tag = "twin"
    assert twin is not model and type(twin) is _Tagged and twin.__dict__["forward"].__self__ is twin
    assert all(is_compiled_module(block) for block in twin.blocks) and is_compiled_module(twin.head)
    assert not has_compiled_regions(model) and model.blocks[0]._compiled_call_impl is None
    x = torch.ones(1, 4)
    assert torch.equal(twin(x), model.head(model.blocks[1](model.blocks[0](x))))
    assert twin.seen == ("twin", "OptimizedModule") and not hasattr(model, "seen")
    assert twin.blocks[0]._orig_mod.weight is model.blocks[0].weight
    assert extract_model_from_parallel(twin) is twin
    assert extract_model_from_parallel(twin, keep_torch_compile=False) is model
    flat = torch.nn.Linear(4, 4)
    whole = compile_regions(flat, backend="eager")
    assert is_compiled_module(whole) and whole._orig_mod is flat


@pytest.mark.parametrize("regional", [False, True])
def test_accelerator_compiles_trains_and_checkpoints_with_clean_names(tmp_path, regional):
    acc = Accelerator(cpu=True, dynamo_plugin=TorchDynamoPlugin(backend="eager", use_regional_compilation=regional))
    raw = make_model()
    model, opt = acc.prepare(raw, torch.optim.SGD(raw.parameters(), lr=0.1))
    assert (model is raw and has_compiled_regions(model)) if regional else is_compiled_module(model)
    acc.backward(loss_fn(model, batches(1)[0]))
    opt.step()
    assert acc.unwrap_model(model, keep_torch_compile=False) is raw
    state = acc.get_state_dict(model)
    assert list(state) == list(raw.state_dict()), "no _orig_mod. prefixes"
    acc.save_state(tmp_path / "ckpt")
    assert not any("_orig_mod" in key for key in load_file(tmp_path / "ckpt" / "model.safetensors"))
    with torch.no_grad():
        raw.head.bias.zero_()
    acc.load_state(tmp_path / "ckpt")
    assert torch.equal(raw.head.bias, state["head.bias"])


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


@pytest.mark.slow
def test_inductor_compiled_model_trains_like_eager(tmp_path):
    acc = Accelerator(cpu=True, dynamo_backend="inductor")
    raw, reference = _mlp(), _mlp()
    model, opt = acc.prepare(raw, torch.optim.SGD(raw.parameters(), lr=0.1))
    assert is_compiled_module(model) and acc.unwrap_model(model, keep_torch_compile=False) is raw
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    data = torch.randn(3, 8, 6, generator=torch.Generator().manual_seed(0))
    for x in data:
        loss = model(x).pow(2).mean()
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        expected = reference(x).pow(2).mean()
        expected.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert abs(loss.item() - expected.item()) < 1e-5
    acc.save_model(model, tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    assert list(saved) == list(reference.state_dict()) and all(
        torch.allclose(saved[k], v, atol=1e-5) for k, v in reference.state_dict().items()
    )
