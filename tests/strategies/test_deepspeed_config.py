"""DeepSpeed configs: key validation with suggestions, "auto" resolution, conflicts, plugin settings.

This logic needs no DeepSpeed: every test here runs against a stand-in for the ``deepspeed`` package, whether
DeepSpeed is installed or not, and ``deepspeed.initialize`` is a recorder (the real engine runs in
tests/strategies/test_deepspeed.py). A test that needs the real package says so with ``requires("deepspeed")``.
"""

import json
import logging
import subprocess
import sys
import types

import pytest
import torch
from helpers import FIXTURES_ROOT, clean_env, requires
from torch.utils.data import DataLoader, TensorDataset

from hasten import Accelerator, DeepSpeedPlugin
from hasten.errors import ConfigError
from hasten.strategies.deepspeed import config as dsc
from hasten.strategies.deepspeed import schema
from hasten.utils import DummyOptim, DummyScheduler

GUIDE_CONFIG = FIXTURES_ROOT / "deepspeed_zero3_auto.json"


class _Recorder:
    """Stands for ``deepspeed.initialize``: records its arguments, returns the model as engine."""

    def __init__(self):
        self.kwargs = None

    def __call__(self, **kwargs):
        self.kwargs = kwargs
        optimizer = kwargs.get("optimizer") or torch.optim.SGD(kwargs["model"].parameters(), lr=0.1)
        return kwargs["model"], optimizer, None, None


pytestmark = pytest.mark.usefixtures("deepspeed")  # the stand-in (tests/strategies/conftest.py)


@pytest.fixture
def initialize(deepspeed, monkeypatch):
    recorder = _Recorder()
    monkeypatch.setattr(deepspeed, "initialize", recorder, raising=False)
    return recorder


def test_the_config_modules_import_where_deepspeed_is_not_installed():
    """In a fresh process where ``import deepspeed`` fails, as it does without the package."""
    code = (
        "import sys; sys.modules['deepspeed'] = None\n"
        "import hasten.strategies.deepspeed.config, hasten.strategies.deepspeed.schema\n"
        "import hasten.strategies.deepspeed.plugin, hasten.strategies.deepspeed.strategy\n"
        "from hasten.strategies.deepspeed import schema\n"
        "assert schema.installed_schema() == schema.SCHEMA\n"
    )
    subprocess.run([sys.executable, "-c", code], env=clean_env(), check=True, timeout=120)


def _model(hidden_size=None):
    model = torch.nn.Linear(4, 2)
    if hidden_size is not None:
        model.config = types.SimpleNamespace(hidden_size=hidden_size)
    return model


def _loader(batch_size=4):
    return DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 2)), batch_size=batch_size)


# ------------------------------------------------------------------------------- validation


def test_misspelled_key_names_the_closest_valid_key():
    config = {"zero_optimization": {"stage": 3, "stage3_gather_16bit_weight_on_model_save": True}}
    with pytest.raises(
        ConfigError,
        match=(
            r"zero_optimization\.stage3_gather_16bit_weight_on_model_save \(did you mean "
            r"'zero_optimization\.stage3_gather_16bit_weights_on_model_save'\?\)"
        ),
    ):
        DeepSpeedPlugin(hf_ds_config=config)


def test_every_unknown_key_is_listed_in_one_error(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(
        json.dumps(
            {
                "gradient_acumulation_steps": 2,
                "fp16": {"enable": True},
                "zero_optimization": {"offload_optimizer": {"devise": "cpu"}},
                "frobnicate": 1,
            }
        )
    )
    with pytest.raises(ConfigError) as error:
        DeepSpeedPlugin(hf_ds_config=str(path))
    message = str(error.value)
    assert f"the DeepSpeed config {str(path)!r} has keys DeepSpeed does not know" in message
    assert "gradient_acumulation_steps (did you mean 'gradient_accumulation_steps'?)" in message
    assert "fp16.enable (did you mean 'fp16.enabled'?)" in message
    assert (
        "zero_optimization.offload_optimizer.devise (did you mean 'zero_optimization.offload_optimizer.device'?)"
        in message
    )
    assert "  - frobnicate\n" in message


def test_free_form_sections_accept_any_key():
    dsc.validate_config(
        {
            "optimizer": {"type": "Lamb", "params": {"max_coeff": 0.3, "anything": 1}},
            "scheduler": {"params": {"cycle_momentum": True}},
        },
        "cfg",
    )


@requires("deepspeed")
def test_static_schema_covers_the_installed_deepspeed(deepspeed):
    import importlib

    for path, (module, name) in schema._MODELS.items():
        section = schema._section(schema.SCHEMA, path)
        fields = getattr(importlib.import_module(module), name).model_fields
        missing = {
            key for field_name, info in fields.items() for key in (field_name, info.alias) if key and key not in section
        }
        assert not missing, (
            f"{path}: keys of DeepSpeed {deepspeed.__version__} missing from hasten's schema: {sorted(missing)}"
        )


@pytest.mark.parametrize(
    "config, message",
    [
        (
            {"zero_optimization": {"stage": 4}},
            r"zero_optimization.stage=4 in cfg is not a ZeRO stage; use 0, 1, 2 or 3",
        ),
        (
            {"zero_optimization": {"stage": 3, "offload_param": {"device": "gpu"}}},
            r"offload_param.device='gpu' in cfg is not one of \['none', 'cpu', 'nvme'\]",
        ),
        (
            {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}},
            r"device is 'nvme' in cfg but no nvme_path is set",
        ),
        (
            {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
            r"offloads parameters \(zero_optimization.offload_param\) with ZeRO stage 2; parameter offload needs "
            r"stage 3",
        ),
        ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, r"enables both fp16 and bf16"),
    ],
)
def test_invalid_values_are_named(config, message):
    with pytest.raises(ConfigError, match=message):
        dsc.validate_config(config, "cfg")


def test_config_file_problems_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match=r"the DeepSpeed config '.*missing.json' does not exist"):
        dsc.load_config(tmp_path / "missing.json")
    broken = tmp_path / "broken.json"
    broken.write_text('{\n  "zero_optimization": {"stage": 3,}\n}')
    with pytest.raises(ConfigError, match=r"broken.json' is not valid JSON: .* at line 2, column 36"):
        dsc.load_config(broken)
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"must hold a JSON object"):
        dsc.load_config(listed)


# ----------------------------------------------------------------------------- the auto table


def test_the_guides_auto_config_resolves_to_the_documented_numbers():
    config, name = dsc.load_config(GUIDE_CONFIG)
    dsc.validate_config(config, name)
    optimizer = {
        "lr": dsc.Setting(3e-5, "DummyOptim"),
        "betas": dsc.Setting([0.9, 0.999], "d"),
        "eps": dsc.Setting(1e-8, "d"),
        "weight_decay": dsc.Setting(0.01, "DummyOptim"),
    }
    scheduler = {
        "warmup_min_lr": dsc.Setting(0, "d"),
        "warmup_max_lr": dsc.Setting(3e-5, "d"),
        "warmup_num_steps": dsc.Setting(500, "d"),
    }
    script = dsc.ScriptValues(
        micro_batch_size=dsc.Setting(8, "loader"),
        num_processes=4,
        gradient_accumulation_steps=dsc.Setting(2, "Accelerator"),
        mixed_precision="fp16",
        hidden_size=dsc.Setting(1024, "hidden"),
        optimizer=optimizer,
        scheduler=scheduler,
    )
    assert dsc.fill(config, dsc.auto_values(script), name) == []
    dsc.check_resolved(config, name)
    assert (
        config["train_micro_batch_size_per_gpu"],
        config["gradient_accumulation_steps"],
        config["train_batch_size"],
    ) == (8, 2, 64)
    assert config["gradient_clipping"] == 1.0 and config["fp16"]["enabled"] is True
    zero = config["zero_optimization"]
    assert zero["reduce_bucket_size"] == 1024 * 1024
    assert zero["stage3_prefetch_bucket_size"] == int(0.9 * 1024 * 1024) == 943718
    assert zero["stage3_param_persistence_threshold"] == 10 * 1024
    assert config["optimizer"]["params"] == {"lr": 3e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}
    assert config["scheduler"]["params"] == {"warmup_min_lr": 0, "warmup_max_lr": 3e-5, "warmup_num_steps": 500}


def test_prepare_fills_auto_from_the_script_and_logs_the_config(initialize, caplog):
    accelerator = Accelerator(
        mixed_precision="bf16",
        gradient_accumulation_steps=2,
        deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=str(GUIDE_CONFIG)),
    )
    model = _model(hidden_size=64)
    optimizer = DummyOptim(model.parameters(), lr=0.02, weight_decay=0.1, betas=(0.8, 0.9))
    scheduler = DummyScheduler(optimizer, warmup_num_steps=7)
    with caplog.at_level(logging.INFO, logger="hasten.deepspeed"):
        accelerator.prepare(model, optimizer, _loader(batch_size=4), scheduler)
    config = initialize.kwargs["config"]
    assert (
        initialize.kwargs["model_parameters"] == [{"params": list(model.parameters())}]
        and "optimizer" not in initialize.kwargs
    )
    assert (
        config["train_micro_batch_size_per_gpu"],
        config["train_batch_size"],
        config["gradient_accumulation_steps"],
    ) == (4, 8, 2)
    assert config["bf16"] == {"enabled": True} and config["fp16"]["enabled"] is False
    assert config["optimizer"]["params"] == {"lr": 0.02, "betas": [0.8, 0.9], "eps": 1e-8, "weight_decay": 0.1}
    assert config["scheduler"]["params"] == {"warmup_min_lr": 0, "warmup_max_lr": 0.02, "warmup_num_steps": 7}
    assert (
        config["zero_optimization"]["reduce_bucket_size"] == 4096
        and config["zero_optimization"]["stage3_param_persistence_threshold"] == 640
    )
    logged = [r.getMessage() for r in caplog.records if "DeepSpeed config in use" in r.getMessage()]
    assert len(logged) == 1 and '"train_batch_size": 8' in logged[0]


def test_auto_values_the_script_cannot_give_are_listed(initialize):
    accelerator = Accelerator(
        deepspeed_plugin=DeepSpeedPlugin(
            hf_ds_config={
                "train_micro_batch_size_per_gpu": "auto",
                "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"},
            }
        )
    )
    model = _model()
    with pytest.raises(ConfigError) as error:
        accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert "train_micro_batch_size_per_gpu: prepare a DataLoader in the same prepare() call as the model" in str(
        error.value
    )
    assert (
        "zero_optimization.reduce_bucket_size: the model has no config.hidden_size; write a number (DeepSpeed's "
        "default is 5e8)" in str(error.value)
    )


def test_plugin_defaults_train_like_ddp(initialize):
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin())
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    accelerator.prepare(model, optimizer, _loader(batch_size=2))
    config = initialize.kwargs["config"]
    assert config["zero_optimization"]["stage"] == 2 and config["gradient_clipping"] == 0.0
    assert (
        config["train_micro_batch_size_per_gpu"],
        config["train_batch_size"],
        config["gradient_accumulation_steps"],
    ) == (2, 2, 1)
    assert initialize.kwargs["optimizer"] is optimizer and config["zero_allow_untested_optimizer"] is True


# -------------------------------------------------------------------------------- conflicts


def test_accumulation_in_the_file_and_in_the_script_must_agree():
    with pytest.raises(
        ConfigError,
        match=(
            r"gradient_accumulation_steps: 4 in the DeepSpeed config dict, but 2 from "
            r"Accelerator\(gradient_accumulation_steps=2\)"
        ),
    ):
        Accelerator(
            gradient_accumulation_steps=2,
            deepspeed_plugin=DeepSpeedPlugin(hf_ds_config={"gradient_accumulation_steps": 4}),
        )


def test_accumulation_from_the_file_is_adopted_by_the_accelerator():
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config={"gradient_accumulation_steps": 4}))
    assert accelerator.gradient_accumulation_steps == 4


def test_plugin_argument_contradicting_the_file_names_both_values():
    with pytest.raises(
        ConfigError,
        match=r"zero_optimization.stage: 3 in the DeepSpeed config dict, but 2 from DeepSpeedPlugin\(zero_stage=2\)",
    ):
        DeepSpeedPlugin(hf_ds_config={"zero_optimization": {"stage": 3}}, zero_stage=2)


def test_launch_setting_contradicting_the_file_names_the_variable(monkeypatch):
    monkeypatch.setenv("HASTEN_DEEPSPEED_ZERO_STAGE", "1")
    with pytest.raises(
        ConfigError,
        match=r"zero_optimization.stage: 3 in the DeepSpeed config dict, but 1 from HASTEN_DEEPSPEED_ZERO_STAGE=1",
    ):
        DeepSpeedPlugin(hf_ds_config={"zero_optimization": {"stage": 3}})


def test_mixed_precision_contradicting_the_file():
    with pytest.raises(
        ConfigError, match=r"mixed_precision='fp16' but the DeepSpeed config dict enables bf16 \(bf16.enabled: true\)"
    ):
        Accelerator(mixed_precision="fp16", deepspeed_plugin=DeepSpeedPlugin(hf_ds_config={"bf16": {"enabled": True}}))


def test_file_precision_wins_over_no_with_a_warning():
    with pytest.warns(UserWarning, match=r"trains in bf16 while mixed_precision is 'no': the DeepSpeed config wins"):
        accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config={"bf16": {"enabled": True}}))
    assert accelerator.mixed_precision == "bf16"


def _record_state_writes(monkeypatch) -> list:
    """Every attribute written on an ``AcceleratorState`` and every plugin a ``GradientState`` is built with, in
    order."""
    from hasten.state import AcceleratorState, GradientState

    writes = []
    monkeypatch.setattr(
        AcceleratorState,
        "__setattr__",
        lambda self, name, value: writes.append((name, value)) or object.__setattr__(self, name, value),
    )
    build = GradientState.__init__

    def recording_init(self, gradient_accumulation_plugin=None):
        writes.append(("GradientState", getattr(gradient_accumulation_plugin, "num_steps", None)))
        build(self, gradient_accumulation_plugin)

    monkeypatch.setattr(GradientState, "__init__", recording_init)
    return writes


def test_bf16_from_a_config_file_is_the_precision_the_state_and_autocast_are_built_with(tmp_path, monkeypatch):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"bf16": {"enabled": True}, "train_micro_batch_size_per_gpu": 1}))
    writes = _record_state_writes(monkeypatch)
    with pytest.warns(UserWarning, match="the DeepSpeed config wins"):
        accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=str(path)))
    assert accelerator.state.mixed_precision == accelerator.mixed_precision == "bf16"
    assert (
        accelerator.precision.mixed_precision == "bf16"
        and accelerator.precision.dtype == torch.bfloat16
        and accelerator.native_amp
    )
    with accelerator.autocast():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    assert [value for name, value in writes if name == "mixed_precision"] == ["bf16"], (
        "the state is built once, with the config's precision"
    )
    assert (
        accelerator.state.distributed_type == "DEEPSPEED"
        and accelerator.state.deepspeed_plugin.config_mixed_precision == "bf16"
    )


def test_a_second_accelerator_takes_its_deepspeed_configs_precision(tmp_path):
    """As in Accelerate, an Accelerator under DeepSpeed may change the precision of an existing state (one
    process building several engines with different configs): no error, the new value."""
    first = Accelerator(mixed_precision="fp16")
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"bf16": {"enabled": True}, "train_micro_batch_size_per_gpu": 1}))
    second = Accelerator(mixed_precision="bf16", deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=str(path)))
    assert second.state.mixed_precision == second.precision.mixed_precision == "bf16"
    assert first.state.mixed_precision == "bf16", "the state is shared, as in Accelerate"


def test_accumulation_from_the_config_is_in_the_gradient_state_from_the_start(tmp_path, monkeypatch):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"gradient_accumulation_steps": 4}))
    writes = _record_state_writes(monkeypatch)
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=str(path)))
    assert [value for name, value in writes if name == "GradientState"] == [4]
    assert accelerator.gradient_accumulation_steps == accelerator.gradient_state.num_steps == 4
    accelerator.gradient_accumulation_steps = 2  # Accelerate's setter stays
    assert accelerator.gradient_accumulation_steps == 2


def test_explicit_file_values_the_script_differs_from_are_reported(initialize, caplog):
    accelerator = Accelerator(
        deepspeed_plugin=DeepSpeedPlugin(
            hf_ds_config={"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1}
        )
    )
    model = _model()
    with caplog.at_level(logging.WARNING, logger="hasten.deepspeed"):
        accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), _loader(batch_size=4))
    assert any(
        "train_micro_batch_size_per_gpu: 8 in the DeepSpeed config dict, but 4 from the prepared dataloader"
        in r.getMessage()
        for r in caplog.records
    )


def test_optimizer_in_both_places_is_refused(initialize):
    accelerator = Accelerator(
        deepspeed_plugin=DeepSpeedPlugin(hf_ds_config={"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}})
    )
    model = _model()
    with pytest.raises(ConfigError, match=r"defines an optimizer and the script passes SGD too. Pass DummyOptim"):
        accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), _loader())


def test_dummy_optim_needs_an_optimizer_section(initialize):
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin())
    model = _model()
    with pytest.raises(
        ConfigError,
        match=r"DummyOptim stands for the optimizer of the DeepSpeed config, but .* has no \"optimizer\" section",
    ):
        accelerator.prepare(model, DummyOptim(model.parameters()), _loader())
    with pytest.raises(ConfigError, match=r"DummyOptim cannot step"):
        DummyOptim(model.parameters()).step()


# --------------------------------------------------------------------------- plugin settings


def test_plugin_reads_the_launch_settings(monkeypatch):
    monkeypatch.setenv("HASTEN_DEEPSPEED_ZERO_STAGE", "3")
    monkeypatch.setenv("HASTEN_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "cpu")
    monkeypatch.setenv("HASTEN_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "nvme")
    monkeypatch.setenv("HASTEN_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH", "/nvme")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL", "true")
    monkeypatch.setenv("HASTEN_GRADIENT_CLIPPING", "0.5")
    plugin = DeepSpeedPlugin()
    zero = plugin.deepspeed_config["zero_optimization"]
    assert zero == {
        "stage": 3,
        "offload_optimizer": {"device": "cpu"},
        "offload_param": {"device": "nvme", "nvme_path": "/nvme"},
        "stage3_gather_16bit_weights_on_model_save": True,
    }
    assert plugin.deepspeed_config["gradient_clipping"] == 0.5 and plugin.zero_stage == 3
    assert plugin.hf_ds_config.is_zero3() and plugin.hf_ds_config.is_offload()


@pytest.mark.parametrize(
    "variable, value, message",
    [
        ("HASTEN_DEEPSPEED_ZERO_STAGE", "5", r"HASTEN_DEEPSPEED_ZERO_STAGE=5: expected 0, 1, 2 or 3"),
        (
            "HASTEN_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
            "gpu",
            r"HASTEN_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE=gpu: expected one of \['none', 'cpu', 'nvme'\]",
        ),
        (
            "HASTEN_GRADIENT_ACCUMULATION_STEPS",
            "0",
            r"HASTEN_GRADIENT_ACCUMULATION_STEPS=0: expected a positive integer or 'auto'",
        ),
        ("HASTEN_DEEPSPEED_ZERO3_INIT", "maybe", r"HASTEN_DEEPSPEED_ZERO3_INIT=maybe: expected true or false"),
    ],
)
def test_bad_launch_settings_name_the_variable(monkeypatch, variable, value, message):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError, match=message):
        DeepSpeedPlugin()


def test_zero3_init_needs_stage_3():
    with pytest.raises(ConfigError, match=r"zero3_init_flag is set but the ZeRO stage is 2"):
        DeepSpeedPlugin(zero3_init_flag=True)
    assert DeepSpeedPlugin(zero_stage=3, zero3_init_flag=True).is_zero3_init_enabled()


def test_accelerate_helper_methods():
    plugin = DeepSpeedPlugin(
        hf_ds_config={
            "train_micro_batch_size_per_gpu": "auto",
            "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8},
        }
    )
    assert plugin.is_auto("train_micro_batch_size_per_gpu") and plugin.get_value("zero_optimization.stage") == 2
    plugin.deepspeed_config_process(
        must_match=False, train_micro_batch_size_per_gpu=4, **{"zero_optimization.reduce_bucket_size": 1}
    )
    assert (
        plugin.get_value("train_micro_batch_size_per_gpu") == 4
        and plugin.get_value("zero_optimization.reduce_bucket_size") == 5e8
    )
    with pytest.raises(
        ConfigError,
        match=r"zero_optimization.reduce_bucket_size: 500000000.0 in the DeepSpeed config dict, but 1 from the script",
    ):
        plugin.deepspeed_config_process(**{"zero_optimization.reduce_bucket_size": 1})


def test_explicit_field_fills_a_key_the_file_sets_to_null():
    plugin = DeepSpeedPlugin(
        hf_ds_config={"gradient_accumulation_steps": None, "zero_optimization": {"stage": 2}},
        gradient_accumulation_steps=4,
    )
    assert plugin.deepspeed_config["gradient_accumulation_steps"] == 4


def test_config_process_skips_keys_the_file_sets_to_null():
    plugin = DeepSpeedPlugin(hf_ds_config={"train_micro_batch_size_per_gpu": None, "zero_optimization": {"stage": 2}})
    plugin.deepspeed_config_process(train_micro_batch_size_per_gpu=4)
    mismatches = []
    plugin.fill_match("zero_optimization.stage", mismatches, **{"zero_optimization.stage": 3})
    assert plugin.get_value("train_micro_batch_size_per_gpu") is None
    assert mismatches == ["zero_optimization.stage: 2 in the DeepSpeed config dict, but 3 from the script"]


def test_zero_init_config_replaces_batch_autos():
    config, _ = dsc.load_config(GUIDE_CONFIG)
    ready = dsc.config_for_zero_init(config, "no")
    assert (
        ready["train_micro_batch_size_per_gpu"],
        ready["gradient_accumulation_steps"],
        ready["fp16"]["enabled"],
    ) == (1, 1, False)
    assert (
        dsc.auto_paths(ready) == []
        and "reduce_bucket_size" not in ready["zero_optimization"]
        and "train_batch_size" not in ready
    )
    assert config["train_batch_size"] == "auto", "the original config is left alone"


@requires("deepspeed")  # DeepSpeed's own set_z3_leaf_modules marks the layers
def test_moe_layer_classes_become_zero3_leaf_modules():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    with pytest.raises(
        ConfigError, match=r"transformer_moe_cls_names lists \['Nope'\], which are not layer classes of this model"
    ):
        DeepSpeedPlugin(zero_stage=3, transformer_moe_cls_names="Linear, Nope").set_moe_leaf_modules(model)
    DeepSpeedPlugin(zero_stage=3, transformer_moe_cls_names="Linear").set_moe_leaf_modules(model)
    assert getattr(model[0], "_z3_leaf", False) and not getattr(model[1], "_z3_leaf", False)


def test_zero3_init_can_be_turned_off_for_a_block():
    plugin = DeepSpeedPlugin(zero_stage=3, zero3_init_flag=True)
    with plugin.zero3_init_context_manager(enable=False):
        assert not plugin.is_zero3_init_enabled()
        model = torch.nn.Linear(3, 3)
    assert plugin.is_zero3_init_enabled() and model.weight.numel() == 9
