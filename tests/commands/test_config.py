"""The launch config file: loading (old and Accelerate-written files), validation, writing, and the merge of sources."""

from __future__ import annotations

import json

import pytest
import yaml
from helpers import FIXTURES_ROOT

from hasten import config as cfg
from hasten.config import ClusterConfig, Hardware, SageMakerConfig
from hasten.errors import ConfigError

FIXTURES = FIXTURES_ROOT / "configs"
CPU = Hardware("cpu", 0)

# file -> {dotted key: expected value}
EXPECTED = {
    "accelerate_0_11_minimal.yaml": {
        "distributed_type": "NO",
        "num_processes": 1,
        "main_process_port": None,
        "mixed_precision": "no",
    },
    "accelerate_0_12_downcast.yaml": {
        "downcast_bf16": False,
        "gpu_ids": "0,1",
        "mixed_precision": "bf16",
        "num_processes": 2,
    },
    "accelerate_0_20_legacy.json": {
        "mixed_precision": "fp16",
        "dynamo_config.dynamo_backend": "INDUCTOR",
        "num_processes": 4,
    },
    "accelerate_0_28_mpi.yaml": {
        "distributed_type": "MULTI_CPU",
        "num_machines": 4,
        "num_processes": 16,
        "main_process_port": 29555,
        "mpirun_config.mpirun_hostfile": "/cluster/hostfile",
        "use_cpu": True,
    },
    "accelerate_0_30_sagemaker.yaml": {
        "distributed_type": "DATA_PARALLEL",
        "ec2_instance_type": "ml.p3.16xlarge",
        "region": "us-east-1",
    },
    "accelerate_0_34_fp8.yaml": {
        "fp8_config.amax_history_length": 16,
        "fp8_config.amax_compute_algorithm": "most_recent",
        "fp8_config.override_linear_precision": (False, False, True),
        "fp8_config.backend": "TE",
        "mixed_precision": "fp8",
    },
    "accelerate_1_x_basic_json_in_yaml.yaml": {"distributed_type": "NO", "use_cpu": True, "same_network": False},
    "accelerate_1_x_deepspeed.yaml": {
        "distributed_type": "DEEPSPEED",
        "deepspeed_config.zero_stage": 3,
        "deepspeed_config.offload_optimizer_device": "cpu",
        "deepspeed_config.offload_param_device": "cpu",
        "deepspeed_config.gradient_accumulation_steps": 4,
        "deepspeed_config.zero3_init_flag": False,
        "deepspeed_config.gradient_clipping": None,
    },
    "accelerate_1_x_fsdp.yaml": {
        "fsdp_config.fsdp_sharding_strategy": "FULL_SHARD",
        "fsdp_config.fsdp_version": 1,
        "fsdp_config.fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
        "fsdp_config.fsdp_reshard_after_forward": None,
        "debug": True,
    },
    "accelerate_1_x_multi_cpu.yaml": {"distributed_type": "MULTI_CPU", "num_processes": 2, "use_cpu": True},
    "hasten_0_1.yaml": {
        "machine_rank": 1,
        "rdzv_backend": "c10d",
        "dynamo_config.dynamo_mode": "max-autotune",
        "main_process_port": 29600,
    },
}
LEGACY = {
    "accelerate_0_20_legacy.json",
    "accelerate_0_28_mpi.yaml",
    "accelerate_0_34_fp8.yaml",
    "accelerate_1_x_fsdp.yaml",
}


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    """No config file of the user's is found (conftest.py clears the HASTEN_*/ACCELERATE_* variables)."""
    monkeypatch.setenv("HASTEN_HOME", str(tmp_path / "home"))


def test_every_fixture_is_listed():
    assert sorted(p.name for p in FIXTURES.iterdir() if p.suffix in (".yaml", ".json")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_loads_with_its_values(name):
    loaded = cfg.read_config_file(FIXTURES / name)
    for path, value in EXPECTED[name].items():
        assert cfg.get_path(loaded.config, path) == value, path
    assert bool(loaded.notes) == (name in LEGACY)
    expected_class = SageMakerConfig if "sagemaker" in name else ClusterConfig
    assert type(loaded.config) is expected_class


def test_migration_notes_say_what_changed():
    notes = cfg.read_config_file(FIXTURES / "accelerate_0_28_mpi.yaml").notes
    assert notes == [
        "ipex_config was dropped (hasten does not use IPEX)",
        "mpirun_config.mpirun_ccl was dropped (oneCCL worker threads are set with CCL_WORKER_COUNT)",
    ]
    legacy = cfg.read_config_file(FIXTURES / "accelerate_0_20_legacy.json").notes
    assert legacy == ["fp16: True became mixed_precision: fp16", "dynamo_backend: INDUCTOR moved into dynamo_config"]


def test_unknown_keys_name_file_key_allowed_keys_and_closest(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("distributed_type: MULTI_CPU\nnum_proceses: 2\ndeepspeed_config:\n  zero_stag: 2\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml") as info:
        cfg.read_config_file(path)
    message = str(info.value)
    assert (
        "unknown key 'num_proceses'. Did you mean 'num_processes'? Allowed keys: compute_environment, distributed_type"
        in message
    )
    assert (
        "unknown key 'deepspeed_config.zero_stag'. Did you mean 'zero_stage'? Allowed keys in deepspeed_config: "
        "deepspeed_config_file" in message
    )


def test_bad_values_list_allowed_values_and_closest(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(
        "distributed_type: MULTI_CPUS\nmixed_precision: bf-16\nfsdp_config:\n  fsdp_offload_params: maybe\n"
        "num_machines: two\n"
    )
    with pytest.raises(ConfigError) as info:
        cfg.read_config_file(path)
    message = str(info.value)
    assert "distributed_type: 'MULTI_CPUS' is not valid; expected one of: NO, MULTI_CPU, MULTI_GPU" in message
    assert "Did you mean 'MULTI_CPU'?" in message
    assert (
        "mixed_precision: 'bf-16' is not valid; expected one of: no, fp16, bf16, fp8. Did you mean 'bf16'?" in message
    )
    assert "fsdp_config.fsdp_offload_params: 'maybe' is not valid; expected a boolean" in message
    assert "num_machines: 'two' is not valid; expected an integer" in message


def test_broken_files_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"missing\.yaml does not exist\. Pass an existing file with --config_file"):
        cfg.read_config_file(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("distributed_type: [unclosed\n")
    with pytest.raises(ConfigError, match=r"broken\.yaml is not valid YAML"):
        cfg.read_config_file(broken)
    listing = tmp_path / "list.yaml"
    listing.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match=r"list\.yaml must be a mapping of keys to values, got list"):
        cfg.read_config_file(listing)
    section = tmp_path / "section.yaml"
    section.write_text("fsdp_config: FULL_SHARD\n")
    with pytest.raises(ConfigError, match=r"'fsdp_config' must be a mapping of keys to values, got 'FULL_SHARD'"):
        cfg.read_config_file(section)
    sagemaker = tmp_path / "sm.yaml"
    sagemaker.write_text("compute_environment: AMAZON_SAGEMAKER\ndistributed_type: NO\n")
    with pytest.raises(ConfigError, match=r"missing key 'ec2_instance_type' \(required for SageMaker\)"):
        cfg.read_config_file(sagemaker)


def test_round_trip_yaml_and_json(tmp_path):
    config = ClusterConfig(distributed_type="FSDP", num_processes=4, debug=True)
    config.fsdp_config.fsdp_reshard_after_forward = True
    config.fp8_config.override_linear_precision = (True, False, False)
    config.megatron_lm_config = {"megatron_lm_tp_degree": 2}
    for name in ("c.yaml", "c.json"):
        path = cfg.save_config_file(config, tmp_path / "sub" / name)
        assert cfg.load_config_file(path) == config
    text = (tmp_path / "sub" / "c.yaml").read_text()
    assert not text.lstrip().startswith("{")
    data = yaml.safe_load(text)
    assert "deepspeed_config" not in data and data["fsdp_config"] == {"fsdp_reshard_after_forward": True}
    assert json.loads((tmp_path / "sub" / "c.json").read_text())["num_processes"] == 4
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == ["c.json", "c.yaml"]  # no temporary file left


def test_write_basic_config_writes_yaml_once(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cfg, "detect_hardware", lambda: CPU)
    path = cfg.write_basic_config(mixed_precision="bf16")
    assert path == tmp_path / "home" / "default_config.yaml"
    data = yaml.safe_load(path.read_text())
    assert not path.read_text().startswith("{")
    assert data == {
        "compute_environment": "LOCAL_MACHINE",
        "debug": False,
        "distributed_type": "NO",
        "downcast_bf16": False,
        "enable_cpu_affinity": False,
        "machine_rank": 0,
        "main_training_function": "main",
        "mixed_precision": "bf16",
        "num_machines": 1,
        "num_processes": 1,
        "rdzv_backend": "static",
        "same_network": False,
        "tpu_use_cluster": False,
        "tpu_use_sudo": False,
        "use_cpu": True,
    }
    assert cfg.write_basic_config(mixed_precision="no") is False
    assert "already exists" in capsys.readouterr().out
    assert yaml.safe_load(path.read_text())["mixed_precision"] == "bf16"
    with pytest.raises(ConfigError, match=r"mixed_precision='fp32' is not valid; expected one of: no, fp16, bf16, fp8"):
        cfg.write_basic_config(mixed_precision="fp32", save_location=tmp_path / "other.yaml")


def test_basic_config_uses_every_gpu():
    config = cfg.basic_config("fp16", Hardware("cuda", 4))
    assert (config.distributed_type, config.num_processes, config.gpu_ids, config.use_cpu) == (
        "MULTI_GPU",
        4,
        "all",
        False,
    )
    single = cfg.basic_config("no", Hardware("cuda", 1))
    assert (single.distributed_type, single.num_processes) == ("NO", 1)


def _loaded(tmp_path, text: str) -> cfg.LoadedConfig:
    path = tmp_path / "launch.yaml"
    path.write_text(text)
    return cfg.read_config_file(path)


def test_merge_order_and_sources(tmp_path):
    loaded = _loaded(tmp_path, "distributed_type: MULTI_CPU\nmixed_precision: fp16\nnum_processes: 2\ndebug: true\n")
    settings = cfg.resolve_settings(
        flags={"mixed_precision": ("bf16", "--mixed_precision"), "deepspeed_config.zero_stage": ("2", "--zero_stage")},
        loaded=loaded,
        env={
            "debug": ("0", "HASTEN_DEBUG_MODE"),
            "dynamo_config.dynamo_backend": ("eager", "ACCELERATE_DYNAMO_BACKEND"),
        },
        hardware=lambda: pytest.fail("the hardware is not needed here"),
    )
    config, sources = settings.config, settings.sources
    assert (config.mixed_precision, config.debug, config.num_processes, config.deepspeed_config.zero_stage) == (
        "bf16",
        True,
        2,
        2,
    )
    assert config.dynamo_config.dynamo_backend == "EAGER"
    assert str(sources["mixed_precision"]) == "flag --mixed_precision"
    assert str(sources["debug"]) == f"config file {loaded.path}"
    assert str(sources["dynamo_config.dynamo_backend"]) == "environment ACCELERATE_DYNAMO_BACKEND"
    assert str(sources["machine_rank"]) == "default"
    assert settings.overridden == [  # BaseConfig's keys come first, as in Accelerate's ClusterConfig
        f"mixed_precision: 'bf16' from flag --mixed_precision overrides 'fp16' from config file {loaded.path}",
        f"debug: True from config file {loaded.path} overrides False from environment HASTEN_DEBUG_MODE",
    ]


def test_merge_reports_every_bad_value():
    with pytest.raises(ConfigError) as info:
        cfg.resolve_settings(
            flags={"deepspeed_config.zero_stage": ("5", "--zero_stage"), "num_processes": ("two", "--num_processes")},
            loaded=None,
            env={"use_cpu": ("maybe", "HASTEN_USE_CPU")},
            hardware=lambda: CPU,
        )
    assert str(info.value) == (
        "Invalid launch settings:\n"
        "  - environment HASTEN_USE_CPU: use_cpu='maybe' is not valid; expected a boolean (true/false, yes/no or 1/0)\n"
        "  - flag --num_processes: num_processes='two' is not valid; expected an integer\n"
        "  - flag --zero_stage: deepspeed_config.zero_stage='5' is not valid; expected one of: 0, 1, 2, 3."
    )


@pytest.mark.parametrize(
    ("flags", "hardware", "expected"),
    [
        ({}, CPU, ("NO", 1, "inferred (no GPU found)")),
        ({}, Hardware("cuda", 2), ("MULTI_GPU", 2, "inferred (2 GPU(s) found)")),
        ({"use_cpu": (True, "--cpu")}, Hardware("cuda", 2), ("NO", 1, "inferred (no GPU found)")),
        ({"num_processes": ("3", "--num_processes")}, CPU, ("MULTI_CPU", 3, "flag --num_processes")),
        ({"num_processes": ("2", "--num_processes")}, Hardware("xpu", 2), ("MULTI_XPU", 2, "flag --num_processes")),
        (
            {
                "num_processes": ("2", "--num_processes"),
                "distributed_type": ("MULTI_GPU", "--multi_gpu"),
                "use_cpu": ("true", "--cpu"),
            },
            Hardware("cuda", 2),
            ("MULTI_CPU", 2, "flag --num_processes"),
        ),
    ],
)
def test_inferred_defaults(flags, hardware, expected):
    settings = cfg.resolve_settings(flags=flags, loaded=None, env={}, hardware=lambda: hardware)
    config = settings.config
    assert (config.distributed_type, config.num_processes, str(settings.sources["num_processes"])) == expected


def test_sagemaker_config_is_refused_for_launch():
    loaded = cfg.read_config_file(FIXTURES / "accelerate_0_30_sagemaker.yaml")
    with pytest.raises(
        ConfigError,
        match=r"accelerate_0_30_sagemaker\.yaml is an Amazon SageMaker config; hasten does not launch on SageMaker",
    ):
        cfg.resolve_settings(flags={}, loaded=loaded, env={}, hardware=lambda: CPU)


def test_environment_settings_read_hasten_then_accelerate(monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    monkeypatch.setenv("HASTEN_MIXED_PRECISION", "bf16")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("FSDP_MIN_NUM_PARAMS", "1000")
    found = cfg.environment_settings()
    assert found == {
        "mixed_precision": ("bf16", "HASTEN_MIXED_PRECISION"),
        "fsdp_config.fsdp_min_num_params": ("1000", "FSDP_MIN_NUM_PARAMS"),
        "distributed_type": ("DEEPSPEED", "ACCELERATE_USE_DEEPSPEED"),
    }


def test_launch_environment_exports_the_settings(tmp_path):
    loaded = cfg.read_config_file(FIXTURES / "accelerate_1_x_deepspeed.yaml")
    settings = cfg.resolve_settings(flags={"debug": (True, "--debug")}, loaded=loaded, env={}, hardware=lambda: CPU)
    env = cfg.launch_environment(settings)
    assert env["HASTEN_USE_DEEPSPEED"] == "true" and env["HASTEN_USE_FSDP"] == "false"
    assert env["HASTEN_DEEPSPEED_ZERO_STAGE"] == "3"
    assert env["HASTEN_DEEPSPEED_OFFLOAD_PARAM_DEVICE"] == "cpu"
    assert env["HASTEN_GRADIENT_ACCUMULATION_STEPS"] == "4"
    assert (
        env["HASTEN_DEBUG_MODE"] == "true"
        and env["HASTEN_MIXED_PRECISION"] == "fp16"
        and env["HASTEN_USE_CPU"] == "false"
    )
    assert env["HASTEN_CONFIG_DS_FIELDS"] == (
        "zero_stage,offload_optimizer_device,offload_param_device,gradient_accumulation_steps,zero3_init_flag,"
        "zero3_save_16bit_model,mixed_precision"
    )
    assert not any(name.startswith("HASTEN_FSDP_") for name in env)
    sources = json.loads(env["HASTEN_LAUNCH_SOURCES"])
    assert sources["debug"] == "flag --debug" and sources["deepspeed_config.zero_stage"] == f"config file {loaded.path}"
    fsdp = cfg.resolve_settings(
        flags={}, loaded=cfg.read_config_file(FIXTURES / "accelerate_1_x_fsdp.yaml"), env={}, hardware=lambda: CPU
    )
    fsdp_env = cfg.launch_environment(fsdp)
    assert fsdp_env["HASTEN_USE_FSDP"] == "true" and fsdp_env["HASTEN_FSDP_SHARDING_STRATEGY"] == "FULL_SHARD"
    assert fsdp_env["HASTEN_FSDP_TRANSFORMER_CLS_TO_WRAP"] == "LlamaDecoderLayer"
    assert not any(name.startswith("HASTEN_DEEPSPEED_") for name in fsdp_env)
    fp8 = cfg.resolve_settings(
        flags={}, loaded=cfg.read_config_file(FIXTURES / "accelerate_0_34_fp8.yaml"), env={}, hardware=lambda: CPU
    )
    fp8_env = cfg.launch_environment(fp8)
    assert (
        fp8_env["HASTEN_FP8_BACKEND"],
        fp8_env["HASTEN_FP8_AMAX_HISTORY_LEN"],
        fp8_env["HASTEN_FP8_OVERRIDE_WGRAD"],
    ) == ("TE", "16", "true")


# ------------------------------------------------------------------------------ bad input, one clear line each


@pytest.mark.parametrize("bare", ["no", "off", "No", "OFF"])
def test_bare_no_for_mixed_precision_means_no(tmp_path, bare):
    path = tmp_path / "hand_written.yaml"
    path.write_text(f"distributed_type: MULTI_CPU\nmixed_precision: {bare}\nnum_processes: 2\n")
    assert yaml.safe_load(path.read_text())["mixed_precision"] is False  # what YAML makes of it
    assert cfg.read_config_file(path).config.mixed_precision == "no"


def test_bare_yes_for_mixed_precision_is_still_refused(tmp_path):
    path = tmp_path / "hand_written.yaml"
    path.write_text("mixed_precision: yes\n")
    with pytest.raises(ConfigError, match=r"mixed_precision: True is not valid; expected one of: no, fp16, bf16, fp8"):
        cfg.read_config_file(path)


def test_binary_file_as_config_says_it_is_not_text(tmp_path):
    path = tmp_path / "model.yaml"
    path.write_bytes(b"PK\x03\x04\x14\x00\x00\x00\x08\x00\xb7\xfa\xff\x00")
    with pytest.raises(ConfigError) as info:
        cfg.read_config_file(path)
    assert str(info.value) == (
        f"Launch config file {path} is not a text file (byte 10 is not UTF-8 text): a launch config is YAML or JSON "
        "text. Pass the file written by `hasten config`, or check that --config_file names the right file."
    )


def test_folder_as_config_says_it_is_a_folder(tmp_path):
    (tmp_path / "default_config.yaml").write_text("num_processes: 2\n")
    with pytest.raises(ConfigError) as info:
        cfg.read_config_file(tmp_path)
    assert str(info.value) == (
        f"--config_file {tmp_path} is a folder, not a file. Pass the config file itself such as "
        f"{tmp_path / 'default_config.yaml'}, or leave --config_file out to use the default file written by `hasten "
        "config`."
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match=r"empty is a folder, not a file\. Pass the config file itself, or leave"):
        cfg.read_config_file(empty)


def test_duplicated_yaml_key_names_the_key_and_both_lines(tmp_path):
    path = tmp_path / "twice.yaml"
    path.write_text("distributed_type: MULTI_CPU\nnum_processes: 2\nmixed_precision: bf16\nnum_processes: 4\n")
    with pytest.raises(ConfigError) as info:
        cfg.read_config_file(path)
    assert str(info.value) == (
        f"Launch config file {path} sets 'num_processes' twice (lines 2 and 4); only one value can be in force. Delete "
        "one of them."
    )


def test_duplicated_key_inside_a_section(tmp_path):
    path = tmp_path / "twice.yaml"
    path.write_text("deepspeed_config:\n  zero_stage: 2\n  offload_param_device: cpu\n  zero_stage: 3\n")
    with pytest.raises(ConfigError, match=r"sets 'zero_stage' twice \(lines 2 and 4\)"):
        cfg.read_config_file(path)


def test_duplicated_json_key_names_the_key(tmp_path):
    path = tmp_path / "twice.json"
    path.write_text('{"num_processes": 2, "num_processes": 4}')
    with pytest.raises(
        ConfigError,
        match=r"twice\.json sets 'num_processes' twice; only one value can be in force\. Delete one of them\.",
    ):
        cfg.read_config_file(path)
