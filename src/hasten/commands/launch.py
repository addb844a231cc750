"""``hasten launch``: merge the config file and the flags, check them, say what is in force, start the processes.

Checks run before any process starts: the script exists, the processes fit on the GPUs, the
rendezvous port is free, the machine settings agree. One process runs the script directly in a
child process; several go through torch's elastic agent (the engine of ``torchrun``) in this
process; ``--mpirun_hostfile`` hands them to ``mpirun``.

Example::

    hasten launch --num_processes 2 train.py --lr 1e-3
    hasten launch --num_machines 2 --machine_rank 0 --main_process_ip 10.0.0.1 --num_processes 16 train.py
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import shutil
import sys
from pathlib import Path

from .. import environment
from ..config import (
    Hardware,
    LoadedConfig,
    ResolvedSettings,
    Source,
    detect_hardware,
    environment_settings,
    launch_environment,
    read_config_file,
    resolve_settings,
)
from ..enums import DistributedType
from ..errors import ConfigError, HastenError, NotSupportedError, did_you_mean, require
from ..launchers import check_port_free
from ..settings.command import command_name
from ..settings.engines import Engine
from ..settings.fp8 import unsupported_backend
from ..settings.launch import (
    AS_ACCELERATE,
    DEBUG,
    DISTRIBUTED_TYPE,
    GPU_IDS,
    MACHINE_RANK,
    MAIN_PROCESS_PORT,
    MIXED_PRECISION,
    NUM_MACHINES,
    NUM_PROCESSES,
)
from . import hang_summary
from .config_location import ConfigLocation, file_to_read, speaks_accelerate
from .launch_args import HelpFormatter, add_launch_arguments, flag_settings
from .launch_plan import LaunchPlan, parse_rdzv_conf

DESCRIPTION = (
    "Start a training script on one or many processes and machines, with the settings of the config file and the flags."
)
_SPELLINGS = "Every option also takes hyphens for its underscores: --num-processes 2 is --num_processes 2."
_ALWAYS_SHOWN = tuple(row.key for row in (DISTRIBUTED_TYPE, NUM_PROCESSES, MIXED_PRECISION, DEBUG))


def add_parser(subparsers, help_text: str) -> argparse.ArgumentParser:
    """Register ``hasten launch``."""
    parser = subparsers.add_parser(
        "launch",
        help=help_text,
        description=f"{DESCRIPTION} {_SPELLINGS}",
        usage="%(prog)s [options] training_script [script arguments]",
        allow_abbrev=False,
        formatter_class=HelpFormatter,
    )
    # Read by hasten's own parser class; harmless on the plain parser of a caller's subparsers (trl's CLI).
    parser.missing_arguments_help = (
        f"{parser.prog} needs the training script to run, after the options: {parser.prog} [options] "
        f"train.py [script arguments], for example `{parser.prog} --num_processes 2 train.py --lr 1e-3`."
    )
    add_launch_arguments(parser)
    parser.set_defaults(func=launch_command)
    return parser


def launch_command_parser(subparsers=None) -> argparse.ArgumentParser:
    """The parser of ``hasten launch``'s flags (Accelerate's ``launch_command_parser``): registered as the
    ``launch`` subcommand of ``subparsers`` when given, else a standalone parser."""
    if subparsers is not None:
        return add_parser(subparsers, DESCRIPTION)
    prog = f"{command_name()} launch"
    parser = argparse.ArgumentParser(
        prog,
        description=f"{DESCRIPTION} {_SPELLINGS}",
        usage=f"{prog} [options] training_script [script arguments]",
        allow_abbrev=False,
        formatter_class=HelpFormatter,
    )
    add_launch_arguments(parser)
    return parser


def launch_command(args: argparse.Namespace) -> int:
    """Run ``hasten launch`` with parsed ``args``; returns the exit code of the job."""
    from . import runners

    environment.check_os_kernel()
    try:
        plan = prepare_launch(args)
    except HastenError as exc:
        _tell_other_machines(args, exc)
        raise
    for line in plan.warnings:
        print(f"{command_name()} launch: warning: {line}", file=sys.stderr)
    if not args.quiet and plan.settings.config.machine_rank == 0:
        print(format_summary(plan), file=sys.stderr, flush=True)
    return runners.run_plan(plan)


def prepare_launch(args: argparse.Namespace, hardware: Hardware | None = None) -> LaunchPlan:
    """Merge and check everything; raises a :class:`~hasten.errors.HastenError` before anything starts."""
    hardware_once = functools.cache(lambda: hardware or detect_hardware())
    location = config_location(args)
    loaded = _load_config(location)
    settings = resolve_settings(
        flags=flag_settings(args), loaded=loaded, env=environment_settings(), hardware=hardware_once
    )
    config = settings.config
    _check_supported(settings)
    nproc = _check_machines(settings)
    _check_devices(settings, nproc, hardware_once)
    if args.training_script is not None:  # the accelerate.utils.launch helpers plan an environment without a script
        _check_script(args)
    _check_launch_options(args)
    if config.machine_rank == 0 and config.main_process_port is not None and not config.mpirun_config.mpirun_hostfile:
        port_source = settings.source(MAIN_PROCESS_PORT)
        fix = f"Pick another port with --main_process_port (now {config.main_process_port}, from {port_source})"
        fix += ", or leave it out on a single machine to get a free one." if config.num_machines == 1 else "."
        check_port_free(config.main_process_ip or "127.0.0.1", config.main_process_port, fix)
    env = launch_environment(settings)
    command = _command(args) if args.training_script is not None else []
    plan = LaunchPlan(
        args=args,
        settings=settings,
        loaded=loaded,
        config_location=location,
        nproc_per_node=nproc,
        command=command,
        env=env,
    )
    engine = _running_engine(settings)
    plan.warnings += settings.overridden + (
        engine.launch_warnings(settings) if engine and engine.launch_warnings else []
    )
    _add_process_environment(plan, hardware_once)
    _add_accelerate_alias(plan)
    if config.debug:
        hang_summary.prepare(plan)
    if loaded is not None and loaded.notes:
        plan.notes.append(
            f"{loaded.path} uses older keys ({'; '.join(loaded.notes)}); `{command_name()} config update --config_file "
            f"{loaded.path}` rewrites it."
        )
    return plan


def _tell_other_machines(args: argparse.Namespace, exc: HastenError) -> None:
    """On a job of several machines, pass this machine's failure to the others so they stop waiting for it."""
    try:
        config = resolve_settings(
            flags=flag_settings(args),
            loaded=_load_config(config_location(args)),
            env=environment_settings(),
            hardware=detect_hardware,
        ).config
        target = (
            config.num_machines,
            config.machine_rank,
            config.main_process_ip,
            config.main_process_port,
            config.rdzv_backend,
        )
    except (HastenError, ValueError):
        flags = (args.num_machines, args.machine_rank, args.main_process_port)
        if not all(str(value or 0).isdigit() for value in flags):
            return
        machines, rank, port = (int(value or 0) for value in flags)
        target = (machines, rank, args.main_process_ip, port, args.rdzv_backend or "static")
    machines, rank, host, port, backend = target
    if machines < 2 or not host or backend not in ("static", "c10d"):
        return
    from .job_agent import REPORT_CONNECT_SECONDS, report_failure_before_join

    print(
        f"{command_name()} launch: machine {rank}: telling the other machines at {host}:{port or 29500} that this "
        f"one cannot start (waiting up to {REPORT_CONNECT_SECONDS:.0f} s for them)",
        file=sys.stderr,
        flush=True,
    )
    message = f"{command_name()} launch: error: {exc}"
    report_failure_before_join(backend, host, port or 29500, "none", machines, rank, message)


def config_location(args: argparse.Namespace) -> ConfigLocation:
    """The launch config file ``args`` ask for (``--config_file``, ``--cpu``, ``--as_accelerate``): see
    :mod:`hasten.commands.config_location`."""
    accelerate = speaks_accelerate(bool(args.as_accelerate) or environment.launch_setting(AS_ACCELERATE))
    return file_to_read(args.config_file, accelerate, cpu=bool(args.cpu))


def _load_config(location: ConfigLocation) -> LoadedConfig | None:
    return read_config_file(location.path) if location.path is not None else None


def _running_engine(settings: ResolvedSettings) -> Engine | None:
    """The registered engine that runs ``settings``' distributed type (None for a type no engine runs)."""
    return next((e for e in environment.ENGINES if settings.config.distributed_type in e.distributed_types), None)


def _check_supported(settings: ResolvedSettings) -> None:
    """The distributed type must be one a registered engine runs."""
    kind = settings.config.distributed_type
    if _running_engine(settings) is None:
        supported = sorted(t for e in environment.ENGINES for t in e.distributed_types)
        raise NotSupportedError(
            f"distributed_type {kind} (from {settings.source(DISTRIBUTED_TYPE)}) is not supported by hasten; it "
            f"runs {', '.join(supported)}. Pick one of those with `{command_name()} config` or a flag (--multi_gpu, "
            "--cpu, ...)."
        )


def _check_machines(settings: ResolvedSettings) -> int:
    """Check the machine settings; returns the number of processes on this machine."""
    config, source = settings.config, settings.source
    if config.num_machines < 1 or config.num_processes < 1:
        raise ConfigError(
            f"num_processes ({config.num_processes}, from {source(NUM_PROCESSES)}) and num_machines "
            f"({config.num_machines}, from {source(NUM_MACHINES)}) must be at least 1."
        )
    if config.num_processes % config.num_machines:
        raise ConfigError(
            f"num_processes={config.num_processes} (from {source(NUM_PROCESSES)}) is the total over all machines "
            f"and must be a multiple of num_machines={config.num_machines} (from {source(NUM_MACHINES)}), e.g. "
            f"--num_processes {config.num_machines * max(config.num_processes // config.num_machines, 1)}."
        )
    if not 0 <= config.machine_rank < config.num_machines:
        raise ConfigError(
            f"machine_rank={config.machine_rank} (from {source(MACHINE_RANK)}) must be between 0 and "
            f"num_machines - 1 = {config.num_machines - 1}."
        )
    _check_port(settings)
    if config.num_machines > 1 and not config.main_process_ip:
        raise ConfigError(
            f"num_machines={config.num_machines} needs the address of machine rank 0: pass --main_process_ip <address> "
            "(the same on every machine), or set main_process_ip in the config file."
        )
    return config.num_processes // config.num_machines


def _check_port(settings: ResolvedSettings) -> None:
    """A TCP port, or 0: a free one (Accelerate's ``--main_process_port 0``), which only a single machine can pick."""
    config, source = settings.config, settings.source(MAIN_PROCESS_PORT)
    port = config.main_process_port
    if port == 0 and config.num_machines == 1:
        config.main_process_port = None  # the launcher picks a free port when none is given
    elif port == 0:
        raise ConfigError(
            f"main_process_port=0 (from {source}) asks for a free port, which each of the {config.num_machines} "
            "machines would pick on its own: give them all the same port, e.g. --main_process_port 29500."
        )
    elif port is not None and not 1 <= port <= 65535:
        raise ConfigError(
            f"main_process_port={port} (from {source}) is not a TCP port: give a number from 1 to 65535, or 0 (or "
            "nothing) on a single machine for a free one."
        )


def _gpu_ids(settings: ResolvedSettings, available: int) -> list[int] | None:
    text = settings.config.gpu_ids
    if text is None or str(text).strip().lower() == "all":
        return None
    try:
        ids = [int(part) for part in str(text).split(",") if part.strip()]
    except ValueError:
        raise ConfigError(
            f"gpu_ids={text!r} (from {settings.source(GPU_IDS)}) must be 'all' or GPU numbers such as 0,1."
        ) from None
    bad = [i for i in ids if not 0 <= i < available]
    if bad or len(set(ids)) != len(ids):
        raise ConfigError(
            f"gpu_ids={text!r} (from {settings.source(GPU_IDS)}) names GPU(s) {bad or ids} but this machine has "
            f"GPUs 0..{available - 1}; each id may appear once."
        )
    return ids


def _check_devices(settings: ResolvedSettings, nproc: int, hardware) -> None:
    config, source = settings.config, settings.source
    kind = config.distributed_type
    requirement = _running_engine(settings).requirement
    if requirement is not None:
        require(requirement.module, f"{requirement.what} (distributed_type {kind})", requirement.extra)
    on_cpu = config.use_cpu or kind == DistributedType.MULTI_CPU.value
    backend = str(config.fp8_config.backend or "AO").upper()
    if config.mixed_precision == "fp8" and backend != "AO":
        raise unsupported_backend(backend, f"fp8_config.backend (from {settings.sources['fp8_config.backend']})")
    if on_cpu:
        return
    gpu_kind = kind in (DistributedType.MULTI_GPU.value, DistributedType.MULTI_XPU.value)
    chosen_gpus = config.gpu_ids not in (None, "all")  # "all" (Accelerate's default) asks for no GPU in particular
    if not gpu_kind and not chosen_gpus and nproc == 1:
        return
    found = hardware()
    if found.gpus == 0:
        if gpu_kind or chosen_gpus:
            raise ConfigError(
                f"distributed_type {kind} (from {source(DISTRIBUTED_TYPE)}) needs GPUs but none was found on this "
                "machine. Pass --cpu to run on the CPU, or check the drivers and CUDA_VISIBLE_DEVICES."
            )
        return
    ids = _gpu_ids(settings, found.gpus)
    usable = len(ids) if ids is not None else found.gpus
    if nproc > usable:
        raise ConfigError(
            f"{nproc} process(es) per machine (num_processes={config.num_processes} from {source(NUM_PROCESSES)}, "
            f"{config.num_machines} machine(s)) but only {usable} GPU(s) can be used"
            f"{' (gpu_ids=' + str(config.gpu_ids) + ')' if ids is not None else ''}. Use --num_processes "
            f"{usable * config.num_machines} or fewer."
        )


def _check_script(args: argparse.Namespace) -> None:
    script = args.training_script
    if args.module and args.no_python:
        raise ConfigError("--module and --no_python cannot be used together: a module needs python.")
    if args.module:
        if importlib.util.find_spec(script.split(".")[0]) is None:
            raise ConfigError(
                f"Module {script!r} (-m) cannot be found by this Python ({sys.executable}); check its name and "
                "PYTHONPATH."
            )
        return
    if args.no_python:
        if shutil.which(script) is None and not Path(script).is_file():
            raise ConfigError(f"Program {script!r} (--no_python) is neither a file nor found on PATH.")
        return
    path = Path(script)
    if path.is_dir() and not (path / "__main__.py").is_file():
        scripts = sorted(entry.name for entry in path.glob("*.py"))
        example = f" such as {path / scripts[0]}" if scripts else ""
        raise ConfigError(
            f"Training script {script!r} is a folder, not a Python file. Pass the script inside it{example}; a folder "
            "runs only when it holds a __main__.py, and a package runs as a module with -m (--module)."
        )
    if not path.exists():
        folder = path.parent if str(path.parent) else Path(".")
        names = [entry.name for entry in folder.iterdir()] if folder.is_dir() else []
        raise ConfigError(
            f"Training script {script!r} does not exist (looked in {folder.resolve()}).{did_you_mean(path.name, names)}"
        )


def _check_launch_options(args: argparse.Namespace) -> None:
    if args.max_restarts is not None and args.max_restarts < 0:
        raise ConfigError(f"--max_restarts must be 0 or more, got {args.max_restarts}.")
    if args.monitor_interval is not None and args.monitor_interval <= 0:
        raise ConfigError(f"--monitor_interval must be a positive number of seconds, got {args.monitor_interval}.")
    if args.num_cpu_threads_per_process is not None and args.num_cpu_threads_per_process < 1:
        raise ConfigError(f"--num_cpu_threads_per_process must be at least 1, got {args.num_cpu_threads_per_process}.")
    if args.tee is not None and not all(part.split(":")[-1] in "0123" for part in args.tee.split(",")):
        raise ConfigError(
            f"--tee {args.tee!r} must be 0, 1, 2 or 3 (none, stdout, stderr, both), or local_rank:value pairs such as "
            "0:3,1:1."
        )
    parse_rdzv_conf(args.rdzv_conf)


def _command(args: argparse.Namespace) -> list[str]:
    if args.no_python:
        return [args.training_script, *args.training_script_args]
    module = ["-m"] if args.module else []
    return [sys.executable, "-u", *module, args.training_script, *args.training_script_args]


def _add_process_environment(plan: LaunchPlan, hardware) -> None:
    """Variables of the process environment itself: threads, visible devices."""
    config, args = plan.settings.config, plan.args
    threads = args.num_cpu_threads_per_process
    if threads is not None:
        plan.env["OMP_NUM_THREADS"] = str(threads)
        plan.launch_sources["num_cpu_threads_per_process"] = Source("flag", "--num_cpu_threads_per_process")
    elif "OMP_NUM_THREADS" not in os.environ and plan.nproc_per_node > 1:
        cpu_job = config.use_cpu or config.distributed_type == DistributedType.MULTI_CPU.value or not hardware().gpus
        cores = _physical_cores() if cpu_job else plan.nproc_per_node
        threads = max(1, cores // plan.nproc_per_node)
        plan.env["OMP_NUM_THREADS"] = str(threads)
        plan.launch_sources["num_cpu_threads_per_process"] = Source(
            "inferred", f"({cores} cores / {plan.nproc_per_node} processes)"
        )
    plan.args.num_cpu_threads_per_process = threads
    if config.use_cpu and plan.nproc_per_node == 1 and config.num_machines == 1:
        # Accelerate's one-process CPU launch: Intel OpenMP keeps its threads on fixed cores, and sleeps soon.
        for name, value in (("KMP_AFFINITY", "granularity=fine,compact,1,0"), ("KMP_BLOCKTIME", "1")):
            if name not in os.environ:
                plan.env[name] = value
    ids = config.gpu_ids
    if ids is not None and str(ids).lower() != "all" and not config.use_cpu:
        variable = "ZE_AFFINITY_MASK" if hardware().kind == "xpu" else "CUDA_VISIBLE_DEVICES"
        plan.env[variable] = str(ids)


def _add_accelerate_alias(plan: LaunchPlan) -> None:
    """``--as_accelerate``: hasten's ``accelerate`` shim first on the processes' ``PYTHONPATH``."""
    if plan.args.as_accelerate:
        plan.launch_sources[AS_ACCELERATE.flag_name] = Source("flag", f"--{AS_ACCELERATE.flag_name}")
    elif environment.launch_setting(AS_ACCELERATE):
        plan.launch_sources[AS_ACCELERATE.flag_name] = Source(
            "environment", environment.setting_source(AS_ACCELERATE.env_name)
        )
        plan.args.as_accelerate = True
    else:
        return
    from ..accelerate_alias import shim_pythonpath

    plan.env["PYTHONPATH"] = shim_pythonpath(os.environ.get("PYTHONPATH"))
    plan.env[AS_ACCELERATE.variable] = "1"


def _physical_cores() -> int:
    import psutil

    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


def format_summary(plan: LaunchPlan) -> str:
    """The short table of settings in force and where each came from (printed unless ``--quiet``)."""
    config, sources = plan.settings.config, plan.settings.sources
    target = " ".join(["python", *plan.command[2:]] if plan.command[0] == sys.executable else plan.command)
    machines = f"{config.num_machines} machines" if config.num_machines > 1 else "1 machine"
    lines = [
        f"{command_name()} launch: {config.num_processes} process(es) on {machines} ({plan.nproc_per_node} here), "
        f"{config.distributed_type}",
        f"  command     : {target}",
        f"  config file : {plan.config_location.describe() if plan.config_location else 'none'}",
    ]
    shown = [p for p in sources if p in _ALWAYS_SHOWN or sources[p].kind != "default"]
    rows = [(path, _show(config, path), str(sources[path])) for path in shown]
    rows += [(name, str(getattr(plan.args, name)), str(source)) for name, source in plan.launch_sources.items()]
    if config.debug and plan.hang_dir is not None:
        rows.append(("hang reports", str(plan.hang_dir), "debug mode"))
    width = max(len(row[0]) for row in rows)
    value_width = min(max(len(row[1]) for row in rows), 40)
    lines += [f"  {name:<{width}}  {value:<{value_width}}  {source}" for name, value, source in rows]
    lines += [f"  note: {note}" for note in plan.notes]
    return "\n".join(lines)


def _show(config, path: str) -> str:
    from ..config import get_path

    value = get_path(config, path)
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def main(argv: list[str] | None = None) -> int:
    """Run ``launch`` with ``argv`` (default: this process's arguments): the ``accelerate-launch`` console script,
    ``python -m hasten.commands.launch`` and ``python -m accelerate.commands.launch``."""
    from .main import run_subcommand

    return run_subcommand("launch", argv)


if __name__ == "__main__":
    sys.exit(main())


def plan_partial_launch(args: argparse.Namespace) -> LaunchPlan:
    """``hasten launch``'s plan for ``args``, a namespace that may hold only some of the launch flags (the others
    take their defaults, as if left out on the command line; a namespace without a script plans no command)."""
    complete = vars(launch_command_parser().parse_args(["-"]))
    complete["training_script"] = None
    complete.update(vars(args))
    return prepare_launch(argparse.Namespace(**complete))


def _validate_launch_command(args: argparse.Namespace) -> tuple[argparse.Namespace, object, bool]:
    """Accelerate's check of a launch's flags: ``(args, the settings in force, whether mixed_precision came from the
    config file)``. hasten plans the launch as ``hasten launch`` would (flags > config file > environment > defaults,
    raising what it raises) and returns ``args`` as given: the helpers here resolve the settings again from them."""
    settings = plan_partial_launch(args).settings
    source = settings.sources.get(MIXED_PRECISION.key)
    return args, settings.config, source is not None and source.kind == "config file"
