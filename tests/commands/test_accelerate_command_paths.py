"""Accelerate's command module paths that its own tests and tools import: ``commands.config`` as a package
(``config_args``, ``default``), ``to_fsdp2``, ``tpu``, the launch helpers ``_validate_launch_command`` and
``_convert_nargs_to_dict``, and ``estimate``'s helpers."""

import subprocess
import sys

import pytest
import yaml

from hasten.commands.config import config_args, default
from hasten.commands.estimate import add_timm_hub_prefix
from hasten.commands.launch import _validate_launch_command, launch_command_parser
from hasten.commands.to_fsdp2 import convert_config_to_fsdp2, to_fsdp2_command, to_fsdp2_command_parser
from hasten.commands.tpu import tpu_command_launcher, tpu_command_parser
from hasten.compat.launch_env import prepare_simple_launcher_cmd_env
from hasten.config import write_basic_config
from hasten.errors import NotSupportedError
from hasten.utils.launch import _convert_nargs_to_dict


def test_config_package_gives_accelerates_classes_and_still_runs_as_a_module():
    base = dict(
        compute_environment="LOCAL_MACHINE", distributed_type="NO", mixed_precision="fp16", debug=False, use_cpu=False
    )
    assert config_args.BaseConfig(**base).mixed_precision == "fp16"
    cluster = config_args.ClusterConfig(**base, num_processes=2, enable_cpu_affinity=True)
    assert isinstance(cluster, config_args.BaseConfig) and cluster.num_processes == 2
    assert isinstance(config_args.SageMakerConfig(ec2_instance_type="ml.p3.2xlarge"), config_args.BaseConfig)
    assert default.write_basic_config is write_basic_config
    out = subprocess.run(
        [sys.executable, "-m", "hasten.commands.config", "--help"], capture_output=True, text=True, check=True
    )
    assert "default" in out.stdout and "update" in out.stdout


def test_to_fsdp2_drops_fsdp1_keys_maps_the_sharding_strategy_and_checks_its_files(tmp_path):
    config = {
        "fsdp_config": {
            "fsdp_sharding_strategy": "SHARD_GRAD_OP",
            "fsdp_use_orig_params": True,
            "fsdp_offload_params": True,
            "x": 5,
        }
    }
    assert convert_config_to_fsdp2(config)["fsdp_config"] == {
        "fsdp_reshard_after_forward": False,
        "fsdp_offload_params": True,
        "x": 5,
        "fsdp_version": 2,
    }
    already = {"fsdp_config": {"fsdp_version": 2, "fsdp_use_orig_params": True}}
    assert convert_config_to_fsdp2(already) == {"fsdp_config": {"fsdp_version": 2, "fsdp_use_orig_params": True}}
    parser = to_fsdp2_command_parser()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        to_fsdp2_command(parser.parse_args(["--config_file", str(tmp_path / "missing.yaml")]))
    source, target = tmp_path / "fsdp1.yaml", tmp_path / "fsdp2.yaml"
    source.write_text(
        yaml.safe_dump({"distributed_type": "FSDP", "fsdp_config": {"fsdp_sharding_strategy": "FULL_SHARD"}})
    )
    with pytest.raises(ValueError, match="--output_file"):
        to_fsdp2_command(parser.parse_args(["--config_file", str(source)]))
    to_fsdp2_command(parser.parse_args(["--config_file", str(source), "--output_file", str(target)]))
    assert yaml.safe_load(target.read_text())["fsdp_config"] == {"fsdp_reshard_after_forward": True, "fsdp_version": 2}
    with pytest.raises(FileExistsError, match="--overwrite"):
        to_fsdp2_command(parser.parse_args(["--config_file", str(source), "--output_file", str(target)]))


def test_tpu_config_parses_accelerates_options_and_refuses_to_run():
    args = tpu_command_parser().parse_args(
        ["--command", "ls", "--tpu_zone", "us-central1-a", "--tpu_name", "t", "--debug"]
    )
    assert (args.tpu_name, args.debug) == ("t", True)
    with pytest.raises(NotSupportedError, match="TPUs"):
        tpu_command_launcher(args)


def test_launch_helpers(tmp_path, monkeypatch):
    monkeypatch.delenv("KMP_AFFINITY", raising=False)
    monkeypatch.delenv("KMP_BLOCKTIME", raising=False)
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    args, config, precision_from_file = _validate_launch_command(
        launch_command_parser().parse_args(["--cpu", str(script)])
    )
    assert config.use_cpu is True and precision_from_file is False
    _, env = prepare_simple_launcher_cmd_env(args)
    assert (env["KMP_AFFINITY"], env["KMP_BLOCKTIME"]) == ("granularity=fine,compact,1,0", "1"), (
        "Accelerate's one-process CPU launch"
    )
    _, env = prepare_simple_launcher_cmd_env(launch_command_parser().parse_args([str(script)]))
    assert "KMP_AFFINITY" not in env
    hyper = _convert_nargs_to_dict(
        ["--model", "bert", "--do_train", "False", "--epochs", "3", "--lr", "5e-5", "--steps", "50.5"]
    )
    assert hyper == {"model": "bert", "do_train": False, "epochs": 3, "lr": 5e-5, "steps": 50.5}
    assert type(hyper["epochs"]) is int
    with pytest.raises(ValueError, match="--do_test has no value"):
        _convert_nargs_to_dict(["--do_test", "--epochs", "3"])


def test_timm_hub_prefix():
    assert [add_timm_hub_prefix(n) for n in ("resnet50", "timm/resnet50.a1", "hf-hub:timm/x", "local-dir:/m")] == [
        "resnet50",
        "hf-hub:timm/resnet50.a1",
        "hf-hub:timm/x",
        "local-dir:/m",
    ]


def test_env_command_returns_its_entries_and_names_the_accelerate_command(monkeypatch, capsys):
    from hasten.commands import env

    monkeypatch.setattr(env, "which", lambda name: None)
    info = env.env_command(env.env_command_parser().parse_args([]))
    assert info["`accelerate` bash location"] == "Not found" and info["hasten version"]
    assert "- `accelerate` bash location: Not found" in capsys.readouterr().out
    monkeypatch.setattr(env, "which", lambda name: f"/opt/bin/{name}")
    assert env.environment_info()["`accelerate` bash location"] == "/opt/bin/accelerate"
