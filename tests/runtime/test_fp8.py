"""fp8 training through torchao (runtime/float8.py, plugins/fp8.py): which layers become float8 ones, the recipes
and settings that choose them, the errors before training, and training itself in torchao's emulation mode (the
same conversion as on an H100, with the float8 matmuls emulated in high precision), alone, compiled, against
Accelerate 1.15 and under FSDP2 on 2 processes started by ``hasten launch --mixed_precision fp8``.

Tests that need torchao skip, saying so, where it is not installed (``pip install 'hasten[fp8]'``).
"""

import importlib.util
import subprocess
import sys

import pytest
import torch
from differential import assert_same
from helpers import ROOT, SCRIPTS, clean_env, hasten_launch, requires
from torch import nn

from hasten import Accelerator
from hasten.errors import ConfigError, MissingDependencyError, NotSupportedError
from hasten.runtime.float8 import default_module_filter, first_and_last_linear
from hasten.state import reset_state

sys.path.insert(0, str(SCRIPTS))
from fp8_model import TinyLM, batch, lm_loss  # noqa: E402


def emulated(**config):
    """An ``AORecipeKwargs`` whose float8 matmuls are emulated (runs on any device)."""
    from torchao.float8 import Float8LinearConfig

    from hasten.utils import AORecipeKwargs

    return AORecipeKwargs(config=Float8LinearConfig(emulate=True, **config))


def float8_layers(model: nn.Module) -> list[str]:
    return sorted(name for name, module in model.named_modules() if type(module).__name__ == "Float8Linear")


def train_tiny_lm(
    mixed_precision: str, handlers: list, steps: int, **accelerator_args
) -> tuple[list[float], nn.Module]:
    reset_state()
    torch.manual_seed(0)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    accelerator = Accelerator(mixed_precision=mixed_precision, kwargs_handlers=handlers, **accelerator_args)
    model, optimizer = accelerator.prepare(model, optimizer)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        inputs, targets = batch(8, generator)
        loss = lm_loss(model(inputs), targets)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model


# ------------------------------------------------------------------------------ which layers


def test_the_filter_keeps_the_first_and_last_linear_layers_and_unaligned_ones_in_high_precision():
    model = nn.Sequential(
        nn.Linear(16, 32),
        nn.ReLU(),
        nn.Linear(32, 32),
        nn.Sequential(nn.Linear(32, 40), nn.Linear(40, 32)),
        nn.Linear(32, 16),
    )
    assert first_and_last_linear(model) == ("0", "4")
    keep = default_module_filter(model)
    assert [name for name, module in model.named_modules() if isinstance(module, nn.Linear) and keep(module, name)] == [
        "2"
    ]
    assert first_and_last_linear(nn.Sequential(nn.ReLU())) == (None, None)


@requires("torchao")
def test_prepare_converts_the_middle_layers_and_leaves_the_optimizer_working():
    """Even with a recipe that asks for FSDP's float8 all-gather, a model FSDP does not shard keeps its parameters:
    the optimizer built before prepare still trains the float8 layers (Accelerate 1.15 replaces those weights and
    the optimizer, holding the old ones, never updates them)."""
    accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[emulated(enable_fsdp_float8_all_gather=True)])
    model = TinyLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    model, optimizer = accelerator.prepare(model, optimizer)
    assert float8_layers(model) == ["blocks.0.fc", "blocks.0.out", "blocks.0.proj"]
    assert all(type(p) is nn.Parameter for p in model.parameters())
    inputs, targets = batch(4, torch.Generator().manual_seed(0))
    accelerator.backward(lm_loss(model(inputs), targets))
    optimizer.step()
    assert all(
        not torch.equal(before[name], p) for name, p in model.named_parameters() if name.startswith("blocks.0.fc")
    )
    assert accelerator.prepare(model) is model and float8_layers(model) == [
        "blocks.0.fc",
        "blocks.0.out",
        "blocks.0.proj",
    ]
    from hasten.utils import get_mixed_precision_context_manager

    with get_mixed_precision_context_manager(
        accelerator.native_amp
    ):  # bf16 autocast around the float8 layers, as Accelerate
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16


@requires("torchao")
def test_a_module_filter_of_the_recipe_decides():
    recipe = emulated()
    recipe.module_filter_func = lambda module, fqn: fqn == "head"
    model = Accelerator(mixed_precision="fp8", kwargs_handlers=[recipe]).prepare(TinyLM())
    assert float8_layers(model) == ["head"]


# ------------------------------------------------------------------------------ training


@requires("torchao")
@pytest.mark.slow
def test_emulated_fp8_trains_a_tiny_lm_as_bf16_does_over_50_steps():
    bf16, _ = train_tiny_lm("bf16", [], 50)
    fp8, model = train_tiny_lm("fp8", [emulated()], 50)
    assert float8_layers(model) == ["blocks.0.fc", "blocks.0.out", "blocks.0.proj"]
    assert fp8[-1] < 0.2 * fp8[0] and bf16[-1] < 0.2 * bf16[0], (bf16, fp8)
    gaps = [abs(a - b) / b for a, b in zip(fp8, bf16)]
    assert max(gaps) < 0.05, list(zip(bf16, fp8))


@requires("torchao")
@pytest.mark.slow
def test_emulated_fp8_composes_with_torch_compile():
    eager, _ = train_tiny_lm("fp8", [emulated()], 3)
    compiled, model = train_tiny_lm("fp8", [emulated()], 3, dynamo_backend="aot_eager")
    assert type(model).__name__ == "OptimizedModule" and float8_layers(model._orig_mod) == [
        "blocks.0.fc",
        "blocks.0.out",
        "blocks.0.proj",
    ]
    assert compiled == pytest.approx(eager, rel=1e-5)


@requires("torchao")
def test_fp8_under_fsdp2_on_one_process_trains_and_saves_plain_weights(monkeypatch, tmp_path):
    """One process: no float8 all-gather (nothing to gather; its weight wrapper would reach the state dict)."""
    monkeypatch.setenv("HASTEN_USE_FSDP", "1")
    accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[emulated(enable_fsdp_float8_all_gather=True)])
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    assert accelerator.is_fsdp2 and float8_layers(model) == ["blocks.0.fc", "blocks.0.out", "blocks.0.proj"]
    before = model.blocks[0].fc.weight.detach().full_tensor().clone()
    inputs, targets = batch(4, torch.Generator().manual_seed(0))
    accelerator.backward(lm_loss(model(inputs), targets))
    optimizer.step()
    assert not torch.equal(before, model.blocks[0].fc.weight.detach().full_tensor())
    state = accelerator.get_state_dict(model)
    assert all(type(value) is torch.Tensor for value in state.values())
    accelerator.save_model(model, tmp_path)
    assert (tmp_path / "model.safetensors").is_file()


@requires("torchao")
@pytest.mark.slow
def test_fp8_under_fsdp2_and_compile_on_two_processes_started_by_hasten_launch():
    launch = (
        "--use_fsdp",
        "--num_processes",
        "2",
        "--cpu",
        "--mixed_precision",
        "fp8",
        "--fp8_backend",
        "ao",
        "--fp8_enable_fsdp_float8_all_gather",
        "true",
        "--fp8_pad_inner_dim",
        "true",
        "--dynamo_backend",
        "aot_eager",
    )
    out = hasten_launch(SCRIPTS / "fp8_fsdp_training.py", launch_args=launch, timeout=600).stdout
    assert "fp8 fsdp ok" in out, out


# ------------------------------------------------------------------------------ settings and recipes


@requires("torchao")
def test_recipe_defaults_follow_the_launch_settings(monkeypatch):
    from hasten.utils import AORecipeKwargs

    config = AORecipeKwargs().config
    assert (config.pad_inner_dim, config.enable_fsdp_float8_all_gather, config.emulate) == (True, True, False)
    monkeypatch.setenv("HASTEN_FP8_PAD_INNER_DIM", "false")
    monkeypatch.setenv("ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER", "0")
    config = AORecipeKwargs().config
    assert (config.pad_inner_dim, config.enable_fsdp_float8_all_gather) == (False, False)
    assert AORecipeKwargs(pad_inner_dim=True).config.pad_inner_dim is True


@requires("torchao")
def test_fp8_recipe_kwargs_means_torchao_and_warns_as_deprecated(monkeypatch):
    from hasten.utils import FP8RecipeKwargs

    with pytest.warns(FutureWarning, match="FP8RecipeKwargs is deprecated"):
        recipe = FP8RecipeKwargs(backend="ao")
    assert recipe.backend == "AO"
    with (
        pytest.warns(FutureWarning),
        pytest.raises(ConfigError, match=r"FP8RecipeKwargs\(margin=...\) is a Transformer Engine"),
    ):
        FP8RecipeKwargs(backend="AO", margin=2)
    with pytest.warns(FutureWarning), pytest.raises(ConfigError, match="backend 'XYZ' is not one of"):
        FP8RecipeKwargs(backend="xyz")
    monkeypatch.setattr(torch, "_scaled_mm", _no_fp8)
    with pytest.warns(FutureWarning):
        handler = FP8RecipeKwargs()
    with pytest.raises(ConfigError, match="needs float8 matrix multiplication"):  # the default recipe: real fp8
        Accelerator(mixed_precision="fp8", kwargs_handlers=[handler])


@pytest.mark.parametrize("backend", ["TE", "msamp"])
def test_transformer_engine_and_msamp_are_refused_naming_the_setting(monkeypatch, backend):
    from hasten.utils import FP8RecipeKwargs, MSAMPRecipeKwargs, TERecipeKwargs

    monkeypatch.setenv("HASTEN_FP8_BACKEND", backend)
    with pytest.raises(
        NotSupportedError,
        match=r"HASTEN_FP8_BACKEND \(fp8_config.backend, --fp8_backend\) selects the fp8 backend .* not supported by "
        r"hasten.*torchao \(AO\)",
    ):
        Accelerator(mixed_precision="fp8")
    with (
        pytest.warns(FutureWarning),
        pytest.raises(
            NotSupportedError,
            match=r"FP8RecipeKwargs\(backend=...\) selects the fp8 backend 'TE' \(Transformer Engine\)",
        ),
    ):
        FP8RecipeKwargs(backend="te")
    for cls in (TERecipeKwargs, MSAMPRecipeKwargs):
        with pytest.raises(NotSupportedError, match="use torchao"):
            cls()


@requires("torchao")
def test_a_recipe_without_fp8_is_refused():
    with pytest.raises(
        ConfigError, match=r"AORecipeKwargs was passed in kwargs_handlers but mixed_precision is 'bf16'"
    ):
        Accelerator(mixed_precision="bf16", kwargs_handlers=[emulated()])


def test_without_torchao_fp8_is_a_clear_import_error(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    with pytest.raises(
        MissingDependencyError, match=r"needs the package 'torchao'.*pip install 'hasten\[fp8\]'"
    ) as raised:
        Accelerator(mixed_precision="fp8")
    assert isinstance(raised.value, ImportError)


def _no_fp8(*args, **kwargs):
    raise RuntimeError("torch._scaled_mm is only supported on CUDA devices with compute capability >= 9.0 or 8.9")


@requires("torchao")
def test_a_device_without_fp8_matmuls_is_refused_before_training_unless_emulated(monkeypatch):
    monkeypatch.setattr(torch, "_scaled_mm", _no_fp8)
    with pytest.raises(
        ConfigError,
        match=r"needs float8 matrix multiplication, which this process's device cannot do: cpu \(torch._scaled_mm: "
        r"torch._scaled_mm is only supported.*emulate=True",
    ):
        Accelerator(mixed_precision="fp8")
    reset_state()
    assert Accelerator(mixed_precision="fp8", kwargs_handlers=[emulated()]).precision.float8 is not None


def test_launch_refuses_other_fp8_backends_before_starting_processes(tmp_path):
    from hasten.commands import launch as launch_cmd
    from hasten.commands.main import build_parser
    from hasten.config import Hardware

    script = tmp_path / "train.py"
    script.write_text("")
    args = build_parser(["launch"]).parse_args(
        ["launch", "--cpu", "--mixed_precision", "fp8", "--fp8_backend", "te", str(script)]
    )
    with pytest.raises(
        NotSupportedError, match=r"fp8_config.backend \(from flag --fp8_backend\) selects the fp8 backend 'TE'"
    ):
        launch_cmd.prepare_launch(args, hardware=Hardware("cpu", 0))


def test_the_dialogue_writes_the_torchao_backend_and_asks_its_two_settings():
    from hasten.settings.dialogue import ask_table
    from hasten.settings.fp8 import FP8

    class No:
        asked = []

        def yes_no(self, message, default=False, check=None):
            self.asked.append((message, default))
            return False

    asker = No()
    assert ask_table(asker, FP8) == {
        "backend": "AO",
        "enable_fsdp_float8_all_gather": False,
        "pad_inner_dim": False,
    }
    assert [default for _, default in asker.asked] == [True, True] and "float8" in asker.asked[0][0]


def test_import_hasten_imports_no_torchao():
    code = (
        "import sys, hasten; from hasten import Accelerator; Accelerator(mixed_precision='bf16'); "
        "print(any(m.startswith('torchao') for m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=clean_env(PYTHONPATH=str(ROOT / "src")),
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "False", out


# ------------------------------------------------------------------------------ against Accelerate 1.15


@pytest.mark.slow
@requires("torchao", "reference")
def test_conversion_and_training_match_accelerate():
    cases = [
        {"seed": seed, "widths": widths, "env": env}
        for seed, (widths, env) in enumerate(
            [
                ([16, 32, 32, 48, 8], {}),
                ([32, 64, 40, 64, 32, 16], {"ACCELERATE_FP8_BACKEND": "AO"}),
                ([16, 16, 16], {"ACCELERATE_FP8_PAD_INNER_DIM": "false"}),
            ]
        )
    ]
    assert_same("fp8_scenarios:conversion_and_steps", cases)
    assert_same("fp8_scenarios:refusals", [{"case": "bf16 with recipe"}])
