"""The `hasten` command line: help speed, the frozen launch flags, argument errors caught before any
process starts, the settings summary, `hasten config` (dialogue in a real terminal, default, update) and
`hasten env`."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pexpect
import pytest
import yaml
from helpers import FIXTURES_ROOT, ROOT, SCRIPTS, requires

from hasten import config as cfg
from hasten.commands import job_agent, launch_args, runners
from hasten.commands import launch as launch_cmd
from hasten.commands.main import build_parser, main
from hasten.config import Hardware
from hasten.errors import ConfigError, NotSupportedError

FIXTURES = FIXTURES_ROOT / "configs"
HASTEN = Path(sys.executable).with_name("hasten")
CPU = Hardware("cpu", 0)

# The launch flags, frozen: adding or removing one must be a deliberate change of this list.
FROZEN_LAUNCH_FLAGS = """
--config_file --quiet --module --no_python --debug --as_accelerate --cpu --multi_gpu --tpu --mixed_precision
--num_processes --num_machines --num_cpu_threads_per_process --enable_cpu_affinity --dynamo_backend --dynamo_mode
--dynamo_use_fullgraph --dynamo_use_dynamic --dynamo_use_regional_compilation --use_deepspeed --use_fsdp
--use_megatron_lm --gpu_ids --same_network --machine_rank --main_process_ip --main_process_port --tee --log_dir
--role --rdzv_backend --rdzv_conf --max_restarts --requeue_on_preemption --monitor_interval --deepspeed_config_file
--zero_stage --offload_optimizer_device --offload_param_device --offload_optimizer_nvme_path --offload_param_nvme_path
--gradient_accumulation_steps --gradient_clipping --zero3_init_flag --zero3_save_16bit_model --deepspeed_hostfile
--deepspeed_exclusion_filter --deepspeed_inclusion_filter --deepspeed_multinode_launcher
--deepspeed_moe_layer_cls_names --parallelism_config_dp_replicate_size --parallelism_config_dp_shard_size
--parallelism_config_tp_size --parallelism_config_cp_size --parallelism_config_cp_backend
--parallelism_config_cp_comm_strategy --parallelism_config_sp_size --parallelism_config_sp_backend
--parallelism_config_sp_seq_length --parallelism_config_sp_seq_length_is_variable
--parallelism_config_sp_attn_implementation --fsdp_version
--fsdp_offload_params --fsdp_min_num_params --fsdp_sharding_strategy
--fsdp_reshard_after_forward --fsdp_auto_wrap_policy --fsdp_transformer_layer_cls_to_wrap --fsdp_backward_prefetch
--fsdp_state_dict_type --fsdp_forward_prefetch --fsdp_use_orig_params --fsdp_cpu_ram_efficient_loading
--fsdp_sync_module_states --fsdp_activation_checkpointing --fp8_backend --fp8_use_autocast_during_eval --fp8_margin
--fp8_interval --fp8_format --fp8_amax_history_len --fp8_amax_compute_algo --fp8_override_linear_precision
--fp8_opt_level --fp8_enable_fsdp_float8_all_gather --fp8_pad_inner_dim --mpirun_hostfile
""".split()


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    """No config file of the user's is found, hasten's or Accelerate's (conftest.py clears the HASTEN_*/ACCELERATE_*
    variables)."""
    monkeypatch.delenv("HF_HOME", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HASTEN_HOME", str(tmp_path / "home"))


def _launch_parser():
    parser = build_parser()
    return next(a for a in parser._subparsers._group_actions[0].choices.items() if a[0] == "launch")[1]


def _args(*argv: str):
    return build_parser(["launch"]).parse_args(["launch", *argv])


# ------------------------------------------------------------------------------ parser


def test_help_does_not_import_torch():
    """What keeps ``hasten --help`` fast (bench/bench_import.py times it): torch is never imported."""
    code = (
        "import sys\nfrom hasten.commands.main import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print('torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip().endswith("False")


def test_launch_flags_are_frozen_and_take_both_spellings():
    options = [a for a in _launch_parser()._actions if a.option_strings and a.dest != "help"]
    names = [next(s for s in a.option_strings if s.startswith("--") and "-" not in s[2:]) for a in options]
    assert names == FROZEN_LAUNCH_FLAGS
    for action, name in zip(options, names):
        if "_" in name:
            assert "--" + name[2:].replace("_", "-") in action.option_strings
    args = _args("--num-processes", "3", "--zero-stage", "2", "x.py")
    assert (args.num_processes, args.zero_stage, args.nondefault) == (3, 2, {"num_processes", "zero_stage"})


def test_launch_flags_left_off_hold_accelerates_values_and_never_override_the_config_file(tmp_path, script):
    """A flag left off holds Accelerate's value (False for a switch, "true" for --fsdp_sync_module_states) but only a
    flag given on the command line, even with that same value, wins over the config file."""
    left_off = _args(script)
    assert (left_off.multi_gpu, left_off.cpu, left_off.use_fsdp, left_off.debug) == (False, False, False, None)
    assert (left_off.fsdp_sync_module_states, left_off.fp8_pad_inner_dim, left_off.max_restarts) == ("true", 1, 0)
    config_file = tmp_path / "c.yaml"
    config_file.write_text("distributed_type: MULTI_CPU\nnum_processes: 2\nrdzv_backend: c10d\nmixed_precision: fp16\n")
    plan = launch_cmd.prepare_launch(_args("--config_file", str(config_file), script), hardware=CPU)
    config = plan.settings.config
    assert (config.distributed_type, config.rdzv_backend, config.mixed_precision) == ("MULTI_CPU", "c10d", "fp16")
    given = _args("--config_file", str(config_file), "--rdzv_backend", "static", "--cpu", script)
    plan = launch_cmd.prepare_launch(given, hardware=CPU)
    assert plan.settings.config.rdzv_backend == "static" and str(plan.settings.sources["rdzv_backend"]) == (
        "flag --rdzv_backend"
    )
    # A namespace built by code records nothing: its values other than the defaults count as given.
    by_hand = argparse.Namespace(**{**vars(_args(script)), "multi_gpu": True, "num_processes": 2})
    assert launch_args.flag_settings(by_hand) == {
        "distributed_type": ("MULTI_GPU", "--multi_gpu"),
        "num_processes": (2, "--num_processes"),
    }


def test_launch_help_shows_one_spelling_per_option(capsys):
    with pytest.raises(SystemExit):
        main(["launch", "-h"])
    out = capsys.readouterr().out
    assert "--num_processes NUM_PROCESSES" in out and "--config_file CONFIG_FILE" in out
    assert out.count("--num-processes") == 1, "named once, in the description that says hyphens work"
    assert "--config-file" not in out and "--fsdp-sync-module-states" not in out


def test_launch_help_groups_options(capsys):
    with pytest.raises(SystemExit):
        main(["launch", "-h"])
    out = capsys.readouterr().out
    titles = [
        "General arguments",
        "Hardware selection arguments",
        "Resource selection arguments",
        "Training paradigm arguments",
    ]
    titles += [
        "Multi-process and multi-machine arguments",
        "DeepSpeed arguments",
        "FSDP arguments",
        "FP8 arguments",
        "MPI arguments",
    ]
    positions = [out.index(title + (":" if "Multi" not in title else "")) for title in titles]
    assert positions == sorted(positions)
    assert out.startswith("usage: hasten launch [options] training_script [script arguments]")


def test_script_arguments_are_passed_untouched():
    args = _args("--num_processes", "1", "train.py", "--num_processes", "7", "--lr", "0.1")
    assert (args.training_script, args.training_script_args) == ("train.py", ["--num_processes", "7", "--lr", "0.1"])


# ------------------------------------------------------------------------------ errors before start


@pytest.fixture
def script(tmp_path) -> str:
    path = tmp_path / "train.py"
    path.write_text("")
    return str(path)


def test_more_processes_than_gpus(script):
    with pytest.raises(
        ConfigError,
        match=r"4 process\(es\) per machine \(num_processes=4 from flag --num_processes, 1 machine\(s\)\) "
        r"but only 2 GPU\(s\) can be used\. Use --num_processes 2 or fewer",
    ):
        launch_cmd.prepare_launch(_args("--multi_gpu", "--num_processes", "4", script), hardware=Hardware("cuda", 2))
    with pytest.raises(ConfigError, match=r"but only 1 GPU\(s\) can be used \(gpu_ids=1\)"):
        launch_cmd.prepare_launch(_args("--num_processes", "2", "--gpu_ids", "1", script), hardware=Hardware("cuda", 2))
    with pytest.raises(
        ConfigError,
        match=r"gpu_ids='0,5' \(from flag --gpu_ids\) names GPU\(s\) \[5\] but this machine has GPUs 0\.\.1",
    ):
        launch_cmd.prepare_launch(
            _args("--num_processes", "2", "--gpu_ids", "0,5", script), hardware=Hardware("cuda", 2)
        )
    with pytest.raises(
        ConfigError, match=r"distributed_type MULTI_GPU \(from flag --multi_gpu\) needs GPUs but none was found"
    ):
        launch_cmd.prepare_launch(_args("--multi_gpu", "--num_processes", "2", script), hardware=CPU)


def test_port_in_use(script):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(
            ConfigError,
            match=rf"Port {port} on 127\.0\.0\.1 is already in use .* Pick another port with --main_process_port "
            rf"\(now {port}, from flag --main_process_port\), or leave it out",
        ):
            launch_cmd.prepare_launch(
                _args("--num_processes", "2", "--main_process_port", str(port), script), hardware=CPU
            )
        with pytest.raises(ConfigError, match=r"10\.255\.255\.1 is not an address of this machine"):
            argv = [
                "--num_machines",
                "2",
                "--num_processes",
                "2",
                "--main_process_ip",
                "10.255.255.1",
                "--main_process_port",
                str(port),
            ]
            launch_cmd.prepare_launch(_args(*argv, script), hardware=CPU)


def test_missing_script_and_programs(tmp_path, script, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        ConfigError, match=r"Training script 'trian.py' does not exist \(looked in .*\)\. Did you mean 'train.py'\?"
    ):
        launch_cmd.prepare_launch(_args("--num_processes", "1", "trian.py"), hardware=CPU)
    with pytest.raises(ConfigError, match=r"Module 'no_such_module_xyz' \(-m\) cannot be found"):
        launch_cmd.prepare_launch(_args("--num_processes", "1", "-m", "no_such_module_xyz"), hardware=CPU)
    with pytest.raises(
        ConfigError, match=r"Program 'no-such-program-xyz' \(--no_python\) is neither a file nor found on PATH"
    ):
        launch_cmd.prepare_launch(_args("--num_processes", "1", "--no_python", "no-such-program-xyz"), hardware=CPU)
    with pytest.raises(ConfigError, match=r"--module and --no_python cannot be used together"):
        launch_cmd.prepare_launch(_args("--num_processes", "1", "-m", "--no_python", "json"), hardware=CPU)


@pytest.mark.parametrize(
    ("argv", "error", "match"),
    [
        (
            ["--num_processes", "3", "--num_machines", "2", "--main_process_ip", "127.0.0.1"],
            ConfigError,
            r"num_processes=3 \(from flag --num_processes\) is the total over all machines and must be a multiple of "
            r"num_machines=2 \(from flag --num_machines\), e\.g\. --num_processes 2",
        ),
        (
            ["--num_machines", "2", "--machine_rank", "2", "--main_process_ip", "127.0.0.1"],
            ConfigError,
            r"machine_rank=2 \(from flag --machine_rank\) must be between 0 and num_machines - 1 = 1",
        ),
        (
            ["--num_machines", "2"],
            ConfigError,
            r"num_machines=2 needs the address of machine rank 0: pass --main_process_ip",
        ),
        (
            ["--num_processes", "0"],
            ConfigError,
            r"num_processes \(0, from flag --num_processes\) and num_machines \(1, from default\) must be at least 1",
        ),
        (["--tpu"], NotSupportedError, r"distributed_type XLA \(from flag --tpu\) is not supported by hasten"),
        (
            ["--use_fsdp", "--use_deepspeed"],
            ConfigError,
            r"Pass at most one of --cpu/--multi_gpu/--tpu/--use_deepspeed/--use_fsdp/--use_megatron_lm; got "
            r"--use_deepspeed, --use_fsdp",
        ),
        (
            ["--use_megatron_lm", "--use_fsdp"],
            ConfigError,
            r"Pass at most one of .*/--use_megatron_lm; got --use_fsdp, --use_megatron_lm",
        ),
        (
            ["--zero_stage", "5"],
            ConfigError,
            r"flag --zero_stage: deepspeed_config\.zero_stage=5 is not valid; expected one of: 0, 1, 2, 3",
        ),
        (
            ["--mixed_precision", "fp8", "--fp8_backend", "msamp"],
            NotSupportedError,
            r"fp8_config\.backend \(from flag --fp8_backend\) selects the fp8 backend 'MSAMP' \(MS-AMP\), which is not "
            r"supported by hasten",
        ),
        (
            ["--monitor_interval", "0"],
            ConfigError,
            r"--monitor_interval must be a positive number of seconds, got 0\.0",
        ),
        (["--rdzv_conf", "timeout"], ConfigError, r"--rdzv_conf item 'timeout' must look like key=value"),
        (["--tee", "5"], ConfigError, r"--tee '5' must be 0, 1, 2 or 3"),
    ],
)
def test_argument_errors(argv, error, match, script):
    with pytest.raises(error, match=match):
        launch_cmd.prepare_launch(_args(*argv, script), hardware=CPU)


def test_invalid_config_file_is_reported_with_file_and_key(tmp_path, script):
    bad = tmp_path / "bad.yaml"
    bad.write_text("distributed_type: MULTI_CPU\nnum_proceses: 2\n")
    with pytest.raises(
        ConfigError,
        match=r"Invalid launch config .*bad\.yaml:\n  - unknown key 'num_proceses'\. Did you mean 'num_processes'\?",
    ):
        launch_cmd.prepare_launch(_args("--config_file", str(bad), script), hardware=CPU)


def test_mistyped_launch_flag_suggests_the_right_one(script, capsys):
    with pytest.raises(SystemExit) as info:
        main(["launch", "--nmu_processes", "2", script])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: hasten launch [options] training_script [script arguments]\n")
    assert (
        "hasten launch: error: unknown option --nmu_processes. Did you mean '--num_processes'? `hasten launch --help` "
        "lists the options." in err
    )


def test_mistyped_flag_with_equals_sign_and_unknown_flag_without_match(capsys):
    with pytest.raises(SystemExit):
        main(["launch", "--mixed-precison=bf16", "train.py"])
    assert "unknown option --mixed-precison. Did you mean '--mixed-precision'?" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["env", "--zzz"])
    assert "hasten env: error: unknown option --zzz. `hasten env --help` lists the options." in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["launch"], ["launch", "--num_processes", "2"]])
def test_launch_without_script_says_one_is_needed(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "training_script_args" not in err
    assert err.endswith(
        "hasten launch: error: hasten launch needs the training script to run, after the options: hasten launch "
        "[options] train.py [script arguments], for example `hasten launch --num_processes 2 train.py --lr 1e-3`.\n"
    )


def test_hand_written_mixed_precision_no_launches(tmp_path, script):
    config_file = tmp_path / "hand.yaml"
    config_file.write_text("distributed_type: MULTI_CPU\nmixed_precision: no\nnum_processes: 2\nuse_cpu: true\n")
    plan = launch_cmd.prepare_launch(_args("--config_file", str(config_file), script), hardware=CPU)
    assert plan.settings.config.mixed_precision == "no" and plan.env["HASTEN_MIXED_PRECISION"] == "no"


def test_errors_exit_before_anything_starts(script, monkeypatch, capsys):
    monkeypatch.setattr(runners, "run_plan", lambda plan: pytest.fail("no process may start"))
    # Machine 0 waits for the other machines to hear of its error (test_faults_launch.py): there are none here.
    monkeypatch.setattr(job_agent, "REPORT_CONNECT_SECONDS", 0.5)
    assert (
        main(["launch", "--num_processes", "3", "--num_machines", "2", "--main_process_ip", "127.0.0.1", script]) == 1
    )
    assert "hasten launch: error: num_processes=3" in capsys.readouterr().err


# ------------------------------------------------------------------------------ summary


def test_summary_says_where_each_value_came_from(tmp_path, script, monkeypatch):
    config_file = tmp_path / "c.yaml"
    config_file.write_text("distributed_type: MULTI_CPU\nnum_processes: 2\nmixed_precision: fp16\n")
    monkeypatch.setenv("HASTEN_DEBUG_MODE", "1")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    plan = launch_cmd.prepare_launch(
        _args("--config_file", str(config_file), "--mixed_precision", "bf16", script, "--lr", "1"), hardware=CPU
    )
    try:
        summary = launch_cmd.format_summary(plan)
    finally:
        plan.hang_dir.rmdir()
    lines = summary.splitlines()
    assert lines[0] == "hasten launch: 2 process(es) on 1 machine (2 here), MULTI_CPU"
    assert lines[1] == f"  command     : python {script} --lr 1"
    assert lines[2] == f"  config file : {config_file} (--config_file)"
    table = {line.split()[0]: line.split(None, 2)[1:] for line in lines[3:]}
    assert table["distributed_type"] == ["MULTI_CPU", f"config file {config_file}"]
    assert table["mixed_precision"] == ["bf16", "flag --mixed_precision"]
    assert table["debug"] == ["true", "environment HASTEN_DEBUG_MODE"]
    assert table["num_cpu_threads_per_process"][1].startswith("inferred (")
    assert table["hang"][1].startswith(str(plan.hang_dir))
    assert plan.settings.overridden == [
        f"mixed_precision: 'bf16' from flag --mixed_precision overrides 'fp16' from config file {config_file}"
    ]
    assert plan.env["HASTEN_HANG_REPORT_DIR"] == str(plan.hang_dir) and plan.owns_hang_dir


@requires("deepspeed")
def test_unused_deepspeed_launcher_is_a_warning(tmp_path, script):
    config_file = tmp_path / "ds.yaml"
    config_file.write_text(
        "distributed_type: DEEPSPEED\nnum_machines: 2\nnum_processes: 2\nmain_process_ip: 127.0.0.1\n"
        "deepspeed_config:\n  deepspeed_multinode_launcher: pdsh\n"
    )
    plan = launch_cmd.prepare_launch(
        _args("--config_file", str(config_file), "--machine_rank", "1", script), hardware=CPU
    )
    assert plan.warnings[:1] == [  # then a line on DeepSpeed's CPU ops where they are not built
        f"deepspeed_multinode_launcher='pdsh' (from config file {config_file}) is not used: hasten launch starts the "
        "processes of this machine only, so run the same command on every machine with its --machine_rank (DeepSpeed's "
        "'standard' launcher)."
    ]


def test_launch_warns_once_about_old_kernels(script, monkeypatch, caplog):
    monkeypatch.setattr(runners, "run_plan", lambda plan: 0)
    monkeypatch.setattr("hasten.environment.system.kernel_version", lambda: (4, 19))
    monkeypatch.setattr("hasten.environment.system._kernel_warned", False)
    with caplog.at_level("WARNING"):
        assert main(["launch", "-q", "--num_processes", "1", script]) == 0
    assert "older than the minimum recommended 5.5.0: distributed jobs are known to hang" in caplog.text


def test_summary_points_to_an_accelerate_config(tmp_path, script, monkeypatch):
    monkeypatch.delenv("HASTEN_HOME")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    accelerate_file = tmp_path / "hf" / "accelerate" / "default_config.yaml"
    accelerate_file.parent.mkdir(parents=True)
    accelerate_file.write_text((FIXTURES / "accelerate_1_x_multi_cpu.yaml").read_text())
    plan = launch_cmd.prepare_launch(_args("--num_processes", "1", script), hardware=CPU)
    assert (
        f"config file : none (found Accelerate's {accelerate_file}: `hasten config update` imports it, or pass it "
        "with --config_file)" in launch_cmd.format_summary(plan)
    )


def test_mpirun_command_lines(tmp_path, script):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1\nnode2\n")
    argv = [
        "--mpirun_hostfile",
        str(hostfile),
        "--num_machines",
        "2",
        "--num_processes",
        "4",
        "--main_process_ip",
        "10.0.0.1",
    ]
    plan = launch_cmd.prepare_launch(_args(*argv, "--cpu", script, "--x"), hardware=CPU)
    command, env = runners.mpirun_command(plan, "openmpi")
    assert command[:7] == ["mpirun", "--hostfile", str(hostfile), "-np", "4", "--npernode", "2"]
    assert command[-4:] == [sys.executable, "-u", script, "--x"]
    assert ("-x", "MASTER_ADDR") in list(zip(command, command[1:])) and env["MASTER_ADDR"] == "10.0.0.1"
    mpich, _ = runners.mpirun_command(plan, "mpich")
    assert mpich[:7] == ["mpirun", "-f", str(hostfile), "-n", "4", "-ppn", "2"]
    assert ["-genv", "MASTER_PORT", "29500"] == mpich[mpich.index("MASTER_PORT") - 1 : mpich.index("MASTER_PORT") + 2]


@requires("deepspeed")
def test_a_killed_worker_gets_the_running_engines_advice(script, capsys):
    killed = {0: SimpleNamespace(exitcode=-9)}
    plan = launch_cmd.prepare_launch(
        _args("--use_deepspeed", "--offload_optimizer_device", "cpu", script), hardware=CPU
    )
    runners._explain_failures(plan, killed)
    assert "A DeepSpeed process was killed by the operating system" in capsys.readouterr().err
    runners._explain_failures(launch_cmd.prepare_launch(_args("--num_processes", "2", script), hardware=CPU), killed)
    assert capsys.readouterr().err == ""


# ------------------------------------------------------------------------------ config / env commands


def test_config_default_and_update(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cfg, "detect_hardware", lambda: CPU)
    assert main(["config", "default", "--mixed_precision", "bf16"]) == 0
    written = tmp_path / "home" / "default_config.yaml"
    assert capsys.readouterr().out == f"hasten configuration saved at {written}\n"
    assert yaml.safe_load(written.read_text())["mixed_precision"] == "bf16"
    assert main(["config", "default"]) == 0
    assert "already exists" in capsys.readouterr().out
    old = tmp_path / "old.yaml"
    old.write_text((FIXTURES / "accelerate_0_28_mpi.yaml").read_text())
    assert main(["config", "update", "--config_file", str(old)]) == 0
    assert capsys.readouterr().out.startswith(f"hasten configuration updated {old} (ipex_config was dropped")
    assert cfg.read_config_file(old).notes == []
    assert cfg.load_config_file(old) == cfg.load_config_file(FIXTURES / "accelerate_0_28_mpi.yaml")


def test_config_update_imports_accelerate_default_file(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("HASTEN_HOME")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    accelerate_file = tmp_path / "hf" / "accelerate" / "default_config.yaml"
    accelerate_file.parent.mkdir(parents=True)
    accelerate_file.write_text((FIXTURES / "accelerate_0_20_legacy.json").read_text())
    assert main(["config", "update"]) == 0
    target = tmp_path / "hf" / "hasten" / "default_config.yaml"
    assert capsys.readouterr().out.startswith(
        f"hasten configuration imported from {accelerate_file} into {target} (fp16: True"
    )
    assert yaml.safe_load(target.read_text())["mixed_precision"] == "fp16"


def test_config_needs_a_terminal(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", open(os.devnull))
    assert main(["config"]) == 1
    assert "needs an interactive terminal; use `hasten config default` in scripts" in capsys.readouterr().err


def test_env_report(tmp_path, capsys):
    config_file = tmp_path / "c.yaml"
    config_file.write_text((FIXTURES / "accelerate_1_x_multi_cpu.yaml").read_text())
    assert main(["env", "--config_file", str(config_file)]) == 0
    out = capsys.readouterr().out
    for expected in (
        "- hasten version: ",
        "- PyTorch version: ",
        "- torch.distributed backends: gloo",
        "- Accelerator: none (CPU only)",
    ):
        assert expected in out
    assert "- Optional packages: numpy " in out and "deepspeed " in out and "- RAM: " in out and "- CPU: " in out
    assert f"- Launch config: {config_file} (--config_file)\n\t- compute_environment: LOCAL_MACHINE" in out
    assert "\t- distributed_type: MULTI_CPU" in out


# ------------------------------------------------------------------------------ the dialogue in a terminal

CPU_WALKTHROUGH = [
    ("compute environment", "\r"),
    ("type of machine", ""),
    ("multi-GPU (not available: no GPU found on this machine)", "2\r"),
    ("different machines", "\r"),
    ("checked while running", "no\r"),
    ("torch dynamo", "\r"),
    ("use DeepSpeed", "yes\r"),
    ("json file", "\r"),
    ("ZeRO optimization stage", "4\r"),
    ("offload optimizer", "2\r"),
    ("offload parameters", "2\r"),
    ("accumulation steps", "4\r"),
    ("gradient clipping", "\r"),
    ("16-bit model", "\r"),
    ("zero.Init", "\r"),
    ("How many processes should be used", "2\r"),
    ("mixed precision", "3\r"),
]
GPU_WALKTHROUGH = [
    ("type of machine", "4\r") if q == "type of machine" else (q, a)
    for q, a in CPU_WALKTHROUGH
    if not q.startswith("multi-GPU")
]
GPU_WALKTHROUGH[-2:] = [("How many GPU(s) should be used", "2\r"), ("mixed precision", "2\r")]
SIMULATED_GPUS = "import torch; torch.cuda.is_available = lambda: True; torch.cuda.device_count = lambda: 2\n"


def run_dialogue(tmp_path: Path, answers: list[tuple[str, str]], prelude: str = "") -> dict:
    """Answer `hasten config` in a pseudo-terminal; returns the file it wrote."""
    target = tmp_path / "answers.yaml"
    code = (
        f"{prelude}from hasten.commands.main import main\n"
        f"raise SystemExit(main(['config', '--config_file', {str(target)!r}]))"
    )
    env = {**os.environ, "PROMPT_TOOLKIT_NO_CPR": "1", "TERM": "xterm-256color"}
    child = pexpect.spawn(sys.executable, ["-c", code], env=env, encoding="utf-8", dimensions=(60, 300), timeout=60)
    for question, answer in answers:
        child.expect_exact(question)
        child.send(answer)
    child.expect_exact(f"hasten configuration saved at {target}")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    return yaml.safe_load(target.read_text())


SEED_DEEPSPEED = {
    "zero_stage": 3,
    "offload_optimizer_device": "cpu",
    "offload_param_device": "cpu",
    "gradient_accumulation_steps": 4,
}
SEED_DEEPSPEED |= {"zero3_save_16bit_model": False, "zero3_init_flag": False}


@pytest.mark.slow
def test_dialogue_on_this_cpu_machine_then_launch(tmp_path):
    written = run_dialogue(tmp_path, CPU_WALKTHROUGH)
    assert written["deepspeed_config"] == SEED_DEEPSPEED
    expected = {
        "distributed_type": "DEEPSPEED",
        "use_cpu": True,
        "num_processes": 2,
        "mixed_precision": "bf16",
        "num_machines": 1,
    }
    assert {key: written[key] for key in expected} == expected
    out = tmp_path / "out"
    launch = [
        str(HASTEN),
        "launch",
        "--config_file",
        str(tmp_path / "answers.yaml"),
        str(SCRIPTS / "cli_dump_env.py"),
        str(out),
    ]
    result = subprocess.run(launch, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "hasten launch: 2 process(es) on 1 machine (2 here), DEEPSPEED" in result.stderr
    for rank in ("0", "1"):
        env = json.loads((out / f"rank{rank}.json").read_text())["env"]
        assert env["WORLD_SIZE"] == "2" and env["RANK"] == rank
        exported = {
            k: env[k]
            for k in (
                "HASTEN_USE_DEEPSPEED",
                "HASTEN_DEEPSPEED_ZERO_STAGE",
                "HASTEN_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
            )
        }
        assert exported == {
            "HASTEN_USE_DEEPSPEED": "true",
            "HASTEN_DEEPSPEED_ZERO_STAGE": "3",
            "HASTEN_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu",
        }
        assert (env["HASTEN_GRADIENT_ACCUMULATION_STEPS"], env["HASTEN_MIXED_PRECISION"], env["HASTEN_USE_CPU"]) == (
            "4",
            "bf16",
            "true",
        )


@pytest.mark.slow
def test_dialogue_with_simulated_gpus_gives_the_walkthrough_file(tmp_path, script):
    written = run_dialogue(tmp_path, GPU_WALKTHROUGH, SIMULATED_GPUS)
    assert written["deepspeed_config"] == SEED_DEEPSPEED
    expected = {"distributed_type": "DEEPSPEED", "use_cpu": False, "num_processes": 2, "mixed_precision": "fp16"}
    assert {key: written[key] for key in expected} == expected
    plan = launch_cmd.prepare_launch(
        _args("--config_file", str(tmp_path / "answers.yaml"), script), hardware=Hardware("cuda", 2)
    )
    assert (plan.nproc_per_node, plan.env["HASTEN_DEEPSPEED_ZERO_STAGE"], plan.env["HASTEN_MIXED_PRECISION"]) == (
        2,
        "3",
        "fp16",
    )


@pytest.mark.slow
def test_dialogue_asks_for_a_whole_number(tmp_path):
    code = (
        "from hasten.commands.main import main\n"
        f"raise SystemExit(main(['config', '--config_file', {str(tmp_path / 'a.yaml')!r}]))"
    )
    env = {**os.environ, "PROMPT_TOOLKIT_NO_CPR": "1", "TERM": "xterm-256color"}
    child = pexpect.spawn(sys.executable, ["-c", code], env=env, encoding="utf-8", dimensions=(60, 300), timeout=60)
    try:
        child.expect_exact("compute environment")
        child.send("\r")
        child.expect_exact("multi-GPU (not available: no GPU found on this machine)")
        child.send("2\r")
        child.expect_exact("different machines")
        child.send("two\r")
        child.expect_exact("Please enter a whole number, such as 2.")
    finally:
        child.terminate(force=True)


def test_merge_command_has_accelerates_path_and_parser():
    """`from accelerate.commands.merge import merge_command, merge_command_parser` (Accelerate's own merge test
    uses it) works: the parser stands alone or joins a caller's subparsers, and the command refuses a folder
    that holds no sharded checkpoint with a clear error."""
    import argparse

    from hasten.commands.merge import merge_command, merge_command_parser
    from hasten.errors import CheckpointError

    args = merge_command_parser().parse_args(["ckpt", "out", "--unsafe_serialization"])
    assert (args.checkpoint_directory, args.output_path, args.safe_serialization) == ("ckpt", "out", False)
    sub = argparse.ArgumentParser().add_subparsers()
    assert merge_command_parser(sub).parse_args(["a", "b"]).func is merge_command
    with pytest.raises(CheckpointError, match="holds neither a DeepSpeed ZeRO checkpoint"):
        merge_command(merge_command_parser().parse_args([str(ROOT / "docs"), str(ROOT / "docs")]))
