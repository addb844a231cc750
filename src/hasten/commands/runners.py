"""How ``hasten launch`` starts the processes of a :class:`~hasten.commands.launch.LaunchPlan`: one
process directly, several through torch's elastic agent (in this process, as ``torchrun`` does), or
``mpirun``; then how a failed job is reported, with the summary of a hang (:mod:`.hang_summary`).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

from .. import environment
from ..errors import ConfigError
from ..settings.command import command_name
from . import hang_summary, preempted, worker_bootstrap
from .launch_plan import LaunchPlan, parse_rdzv_conf


def run_plan(plan: LaunchPlan) -> int:
    """Start the job described by ``plan`` and wait for it; returns its exit code."""
    config = plan.settings.config
    preempted.prepare(plan)
    if plan.hang_dir is None and config.num_processes > 1:
        hang_summary.prepare(plan)
    try:
        if config.mpirun_config.mpirun_hostfile:
            code = run_mpirun(plan)
        elif config.num_processes == 1:
            code = run_single(plan)
        else:
            code = run_elastic(plan)
        code = preempted.conclude(plan, code, signalled=code - 128 in (signal.SIGTERM, signal.SIGUSR1))
        if code != 0:
            report = hang_summary.summarize(plan.hang_dir)
            if report:
                print(report, file=sys.stderr, flush=True)
        return code
    finally:
        preempted.cleanup(plan)
        if plan.owns_hang_dir and plan.hang_dir is not None:
            shutil.rmtree(plan.hang_dir, ignore_errors=True)


def _wait(process: subprocess.Popen) -> int:
    """Wait for ``process``, passing SIGTERM on to it; after Ctrl-C give it time to stop by itself."""
    previous = {
        sig: signal.signal(sig, lambda signum, frame: process.send_signal(signum))
        for sig in (signal.SIGTERM, signal.SIGUSR1)
    }
    try:
        return process.wait()
    except KeyboardInterrupt:  # a terminal sends SIGINT to the child too; interrupt it only if it ignores that
        try:
            return process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGINT)
            return process.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def worker_command(plan: LaunchPlan) -> list[str]:
    """The command of one worker: the script (or module, or program) started through the bootstrap
    that ties the worker's life to this launcher's."""
    args = plan.args
    program = [args.training_script, *args.training_script_args]
    return worker_bootstrap.command(os.getpid(), program, module=args.module, no_python=args.no_python)


def run_single(plan: LaunchPlan) -> int:
    """Run the script once, in a child process with the launch variables."""
    with subprocess.Popen(worker_command(plan), env={**os.environ, **plan.env}) as process:
        return _wait(process)


def _rendezvous(plan: LaunchPlan) -> tuple[str, str, dict, str, str | None]:
    """(backend, endpoint, configs, run id, local address) of the rendezvous."""
    config = plan.settings.config
    conf: dict = parse_rdzv_conf(plan.args.rdzv_conf)
    single = config.num_machines == 1
    if single and config.main_process_port is None:
        # As torchrun does on one machine: a c10d store on a free port, here bound to the loopback address.
        return "c10d", "127.0.0.1:0", conf, uuid.uuid4().hex, "127.0.0.1"
    host = config.main_process_ip or "127.0.0.1"
    port = config.main_process_port or 29500
    endpoint = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if config.rdzv_backend == "static":
        conf["rank"] = config.machine_rank
    elif config.rdzv_backend == "c10d":
        conf.setdefault("is_host", str(config.machine_rank == 0).lower())  # not "whoever matches the address first"
    return config.rdzv_backend, endpoint, conf, "none", "127.0.0.1" if single else None


def run_elastic(plan: LaunchPlan) -> int:
    """Start ``nproc_per_node`` processes through torch's elastic agent and wait for all of them."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher.api import LaunchConfig

    from . import job_agent

    args, config = plan.args, plan.settings.config
    backend, endpoint, rdzv_configs, run_id, local_addr = _rendezvous(plan)
    launch_config = LaunchConfig(
        min_nodes=config.num_machines,
        max_nodes=config.num_machines,
        nproc_per_node=plan.nproc_per_node,
        run_id=run_id,
        role=args.role or "default",
        rdzv_endpoint=endpoint,
        rdzv_backend=backend,
        rdzv_configs=rdzv_configs,
        max_restarts=args.max_restarts or 0,
        monitor_interval=args.monitor_interval or 0.1,
        start_method="spawn",
        local_addr=local_addr,
        logs_specs=DefaultLogsSpecs(log_dir=args.log_dir, redirects=Std.NONE, tee=Std.from_str(args.tee or "0")),
        **preempted.elastic_options({f.name for f in dataclasses.fields(LaunchConfig)}),
    )
    os.environ.update(plan.env)  # the agent hands its own environment to the workers
    command = worker_command(plan)
    try:
        job_agent.launch(
            launch_config,
            command[0],
            command[1:],
            config.machine_rank,
            describe_exit,
            _join_announcement(plan, endpoint),
        )
    except job_agent.JobFailure as exc:
        print(
            f"{command_name()} launch: machine {config.machine_rank} stopped: {exc.describe()}",
            file=sys.stderr,
            flush=True,
        )
        return exc.exitcode
    except ChildFailedError as exc:
        if preempted.saved_record(plan) is None:  # a worker signalled alone: its group saved and exited with 75
            machine = config.machine_rank if config.num_machines > 1 else None
            hang = hang_summary.load(plan.hang_dir)
            print(describe_failures(exc.failures, config.num_processes, machine, hang), file=sys.stderr, flush=True)
        _explain_failures(plan, exc.failures)
        first = exc.get_first_failure()[1].exitcode
        return first if first > 0 else 1
    except RendezvousError as exc:
        print(
            f"{command_name()} launch: the rendezvous at {endpoint} failed: {exc}\nCheck that every machine runs the "
            "same command with its own --machine_rank, and that machine rank 0 is reachable at "
            "--main_process_ip/--main_process_port.",
            file=sys.stderr,
        )
        return 1
    except SignalException as exc:
        if preempted.saved_record(plan) is None:
            print(
                f"{command_name()} launch: stopped by signal {exc.sigval.name}; the processes were terminated.",
                file=sys.stderr,
            )
        return 128 + int(exc.sigval)
    return 0


def _join_announcement(plan: LaunchPlan, endpoint: str) -> str | None:
    config = plan.settings.config
    if config.num_machines == 1 or plan.args.quiet:
        return None
    timeout = parse_rdzv_conf(plan.args.rdzv_conf).get(
        "join_timeout" if config.rdzv_backend != "static" else "timeout", "600"
    )
    return (
        f"{command_name()} launch: machine {config.machine_rank} waiting for all {config.num_machines} machines to "
        f"join at {endpoint} (up to {timeout} s)"
    )


def describe_exit(code: int) -> str:
    """How a process ended, from its exit code (negative: the signal that killed it)."""
    return f"exit code {code}" if code >= 0 else f"killed by signal {_signal_name(-code)}"


def describe_failures(failures: dict, world_size: int, machine: int | None = None, hang: list | None = None) -> str:
    """A few lines saying which ranks failed and how (their own output is above); ``hang``: the hang reports
    (:func:`hang_summary.load`), which say which process did not arrive and which ones waited."""
    where = f" on machine {machine}" if machine is not None else ""
    lines = [
        f"{command_name()} launch: {len(failures)} of {world_size} process(es) failed{where} (their output is above):"
    ]
    others_failed = any(failure.exitcode > 0 for failure in failures.values())
    for rank, failure in sorted(failures.items()):
        code = failure.exitcode
        how = describe_exit(code)
        in_hang = hang_summary.role(hang or [], rank)
        if code == -signal.SIGTERM and others_failed:
            how = "stopped by the launcher (SIGTERM)" + ("" if in_hang else " after another process failed")
        if in_hang:
            how += f"; {in_hang}"
        lines.append(f"  rank {rank} (local rank {failure.local_rank}, pid {failure.pid}): {how}")
    return "\n".join(lines)


def _explain_failures(plan: LaunchPlan, failures: dict) -> None:
    """The running engine's advice on the first failure it can explain (DeepSpeed: a worker the operating system
    killed, usually out of CPU memory)."""
    kind = plan.settings.config.distributed_type
    engine = next((e for e in environment.ENGINES if kind in e.distributed_types), None)
    if engine is None or engine.explain_failure is None:
        return
    for failure in failures.values():
        advice = engine.explain_failure(plan.env, failure.exitcode)
        if advice:
            print(advice, file=sys.stderr, flush=True)
            return


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def mpirun_command(plan: LaunchPlan, flavour: str) -> tuple[list[str], dict[str, str]]:
    """The ``mpirun`` command line and its variables; ``flavour`` is ``"openmpi"`` or ``"mpich"`` (also Intel MPI)."""
    config = plan.settings.config
    hostfile = Path(config.mpirun_config.mpirun_hostfile).expanduser()
    if not hostfile.is_file():
        raise ConfigError(f"mpirun_hostfile {hostfile} does not exist; it lists the machines, one per line.")
    env = {
        **plan.env,
        "MASTER_ADDR": config.main_process_ip or "127.0.0.1",
        "MASTER_PORT": str(config.main_process_port or 29500),
    }
    total, per_node = str(config.num_processes), str(plan.nproc_per_node)
    if flavour == "openmpi":
        command = ["mpirun", "--hostfile", str(hostfile), "-np", total, "--npernode", per_node]
        command += [part for name in env for part in ("-x", name)]
    else:
        command = ["mpirun", "-f", str(hostfile), "-n", total, "-ppn", per_node]
        command += [part for name, value in env.items() for part in ("-genv", name, value)]
    return command + plan.command, env


def run_mpirun(plan: LaunchPlan) -> int:
    """Start all processes of all machines with ``mpirun`` (run this on one machine only)."""
    if shutil.which("mpirun") is None:
        raise ConfigError(
            "mpirun_hostfile is set but `mpirun` is not on PATH; install an MPI (Open MPI, MPICH or Intel MPI)."
        )
    version = subprocess.run(["mpirun", "--version"], capture_output=True, text=True, check=False)
    text = version.stdout + version.stderr
    flavour = "openmpi" if "Open MPI" in text or "OpenRTE" in text else "mpich"
    command, env = mpirun_command(plan, flavour)
    with subprocess.Popen(command, env={**os.environ, **env}) as process:
        return _wait(process)
