"""`hasten launch` and `hasten test` starting real processes: an Accelerate-written config, a simulated
two-machine job, the hang report summary, single-process paths, exported settings and mpirun."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import FIXTURES_ROOT, ROOT, SCRIPTS

FIXTURES = FIXTURES_ROOT / "configs"
HASTEN = str(Path(sys.executable).with_name("hasten"))
SELF_CHECK = str(ROOT / "src" / "hasten" / "test_utils" / "scripts" / "test_script.py")
SUCCESS = "Test is a success! You are ready for your distributed training!"


@pytest.fixture
def env(tmp_path) -> dict[str, str]:
    clean = {
        k: v for k, v in os.environ.items() if not k.startswith(("HASTEN_", "ACCELERATE_")) and k != "OMP_NUM_THREADS"
    }
    return {**clean, "HASTEN_HOME": str(tmp_path / "home")}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _run(argv: list[str], env: dict, cwd: Path, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def _seen(folder: Path, rank: str) -> dict:
    return json.loads((folder / f"rank{rank}.json").read_text())


@pytest.mark.slow
def test_accelerate_written_config_passes_the_self_check(env, tmp_path):
    result = _run([HASTEN, "test", "--config_file", str(FIXTURES / "accelerate_1_x_multi_cpu.yaml")], env, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert SUCCESS in result.stdout
    assert (
        "Distributed environment: DistributedType.MULTI_CPU  Backend: gloo\nNum processes: 2" in result.stdout
    )  # as Accelerate prints it
    assert "collectives: ok" in result.stdout and "training step: ok" in result.stdout
    assert f"config file : {FIXTURES / 'accelerate_1_x_multi_cpu.yaml'}" in result.stderr


@pytest.mark.slow
def test_two_simulated_machines_form_one_job(env, tmp_path):
    port = _free_port()
    common = [
        "launch",
        "--num_machines",
        "2",
        "--num_processes",
        "2",
        "--main_process_ip",
        "127.0.0.1",
        "--main_process_port",
        str(port),
    ]
    machines = [
        subprocess.Popen(
            [HASTEN, *common, "--machine_rank", rank, SELF_CHECK],
            env=env,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in ("0", "1")
    ]
    outputs = [machine.communicate(timeout=180) for machine in machines]
    for machine, (out, err) in zip(machines, outputs):
        assert machine.returncode == 0, out + err
    main_out, main_err = outputs[0]
    assert SUCCESS in main_out and "Num processes: 2" in main_out
    assert "hasten launch: 2 process(es) on 2 machines (1 here), MULTI_CPU" in main_err
    assert "process(es) on 2 machines" not in outputs[1][1]  # the summary is printed by machine rank 0 only
    for rank, (_, err) in enumerate(outputs):
        assert (
            f"hasten launch: machine {rank} waiting for all 2 machines to join at 127.0.0.1:{port} (up to 600 s)" in err
        )


@pytest.mark.slow
@pytest.mark.serial  # a hang watchdog's timing: beside busy cores its first line once said otherwise
def test_the_launcher_summarises_a_hang_report_in_every_mode(env, tmp_path):
    # Before, only `--debug` gave the processes a folder for hang reports, so outside debug mode no summary came.
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    env = {**env, "TMPDIR": str(temporary)}
    result = _run([HASTEN, "launch", "--num_processes", "2", str(SCRIPTS / "cli_hang_report.py")], env, tmp_path)
    assert result.returncode == 3
    err = result.stderr
    assert "hasten launch: 1 of 2 process(es) failed (their output is above):" in err
    assert (
        "  rank 1 (local rank 1, pid " in err
        and "): exit code 3; ended by the hang watchdog after it waited in collective #12 of the default process group"
        in err
    ), err
    summary = err[err.index("hasten launch: the job hung") :].splitlines()
    assert summary == [
        "hasten launch: the job hung in collective #12 of the default process group: rank 0 did not arrive "
        "(HASTEN_HANG_TIMEOUT=12):",
        "  rank 0 exited without arriving (its last collective there is #11)",
        "  rank 1 waited 12.5 s in it, inside `hasten.runtime.operations.reduce`; its hang watchdog ended the job; it "
        "was at:",
        '      File "train.py", line 40, in <module>',
        "        main()",
        '      File "train.py", line 31, in main',
        "        total = accelerator.reduce(loss)",
        "  Every process's stacks are in the hang report that rank 1 printed.",
    ]
    assert not list(temporary.glob("hasten-hang-*"))  # the launcher's temporary folder is removed


@pytest.mark.slow
def test_settings_reach_every_process(env, tmp_path):
    out = tmp_path / "out"
    flags = [
        "--num_processes",
        "2",
        "--mixed_precision",
        "bf16",
        "--debug",
        "--use_fsdp",
        "--fsdp_sharding_strategy",
        "SHARD_GRAD_OP",
    ]
    flags += ["--fsdp-offload-params", "true", "--dynamo_backend", "eager", "--num_cpu_threads_per_process", "1", "-q"]
    result = _run(
        [HASTEN, "launch", *flags, str(SCRIPTS / "cli_dump_env.py"), str(out), "--flag", "x"],
        {**env, "HASTEN_HANG_TIMEOUT": "7"},
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""  # --quiet: no summary
    for rank in ("0", "1"):
        seen = _seen(out, rank)
        assert seen["argv"] == [str(out), "--flag", "x"]
        values = seen["env"]
        assert (values["LOCAL_RANK"], values["WORLD_SIZE"], values["OMP_NUM_THREADS"]) == (rank, "2", "1")
        expected = {
            "HASTEN_MIXED_PRECISION": "bf16",
            "HASTEN_DEBUG_MODE": "true",
            "HASTEN_USE_FSDP": "true",
            "HASTEN_FSDP_SHARDING_STRATEGY": "SHARD_GRAD_OP",
            "HASTEN_FSDP_OFFLOAD_PARAMS": "true",
            "HASTEN_DYNAMO_BACKEND": "EAGER",
            "HASTEN_LAUNCHED": "1",
            "HASTEN_HANG_TIMEOUT": "7",
        }
        assert {key: values.get(key) for key in expected} == expected
        assert json.loads(values["HASTEN_LAUNCH_SOURCES"])["mixed_precision"] == "flag --mixed_precision"


def test_single_process_runs_the_script_directly(env, tmp_path):
    out = tmp_path / "out"
    result = _run(
        [HASTEN, "launch", "--num_processes", "1", str(SCRIPTS / "cli_dump_env.py"), str(out), "a", "--b"],
        env,
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    seen = _seen(out, "none")  # no RANK: not started by the elastic agent
    assert seen["argv"] == [str(out), "a", "--b"]
    assert seen["env"]["HASTEN_LAUNCHED"] == "1" and "WORLD_SIZE" not in seen["env"]
    assert "hasten launch: 1 process(es) on 1 machine (1 here), NO" in result.stderr
    module = _run(
        [HASTEN, "launch", "--num_processes", "1", "-q", "-m", "cli_dump_env", str(tmp_path / "m")],
        {**env, "PYTHONPATH": str(SCRIPTS)},
        tmp_path,
    )
    assert module.returncode == 0, module.stderr
    assert _seen(tmp_path / "m", "none")["argv"] == [str(tmp_path / "m")]
    program = tmp_path / "program.sh"
    program.write_text("#!/bin/sh\nexit 4\n")
    program.chmod(0o755)
    failing = _run([HASTEN, "launch", "--num_processes", "1", "-q", "--no_python", str(program)], env, tmp_path)
    assert failing.returncode == 4


def test_mpirun_hostfile_hands_the_job_to_mpirun(env, tmp_path):
    fake = tmp_path / "bin" / "mpirun"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\nexec {sys.executable} {SCRIPTS / "cli_fake_mpirun.py"} "$@"\n')
    fake.chmod(0o755)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\n")
    record = tmp_path / "mpirun.json"
    run_env = {**env, "PATH": f"{fake.parent}{os.pathsep}{env['PATH']}", "FAKE_MPIRUN_OUT": str(record)}
    argv = [
        HASTEN,
        "launch",
        "-q",
        "--cpu",
        "--num_processes",
        "2",
        "--mpirun_hostfile",
        str(hostfile),
        "--mixed_precision",
        "bf16",
        "train.py",
    ]
    (tmp_path / "train.py").write_text("")
    result = _run(argv, run_env, tmp_path)
    assert result.returncode == 0, result.stderr
    seen = json.loads(record.read_text())
    assert seen["argv"][:6] == ["--hostfile", str(hostfile), "-np", "2", "--npernode", "2"]
    assert Path(seen["argv"][-3]).resolve() == Path(sys.executable).resolve() and seen["argv"][-2:] == [
        "-u",
        "train.py",
    ]
    assert seen["exported"]["HASTEN_MIXED_PRECISION"] == "bf16" and seen["exported"]["MASTER_ADDR"] == "127.0.0.1"
    assert seen["exported"]["HASTEN_USE_CPU"] == "true"
