"""The flags of ``hasten launch``: one table that builds the parser (grouped as Accelerate's ``-h``
groups them) and says which config setting each flag fills.

Every flag accepts the ``_`` and the ``-`` spelling. Flags that fill a config setting are parsed as
plain strings and checked by :func:`hasten.config.resolve_settings`, so a bad value gets the same
message whether it came from a flag, the config file or the environment.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from ..config import leaf_fields
from ..settings import Section
from ..settings.deepspeed import DEEPSPEED
from ..settings.dynamo import DYNAMO
from ..settings.fp8 import FP8
from ..settings.fsdp import FSDP
from ..settings.parallelism import PARALLELISM

_BOOL = "{true,false}"


@dataclass(frozen=True, slots=True)
class Flag:
    """One ``hasten launch`` option.

    ``path`` is the dotted config setting it fills (None for launch-only options); a ``switch`` takes
    no value and stores ``const`` (default True).
    """

    name: str
    group: str
    help: str
    path: str | None = None
    switch: bool = False
    const: object = True
    short: str | None = None
    type: type = str
    metavar: str | None = None


def _table_flags(table: Section, group: str) -> tuple[Flag, ...]:
    """The launch options of a settings table's rows (a boolean option that is not a switch takes true or false)."""
    return tuple(
        Flag(
            row.flag_name,
            group,
            row.flag_help,
            f"{table.name}.{row.key}",
            switch=row.switch,
            metavar=_BOOL if row.kind == "bool" and not row.switch else None,
        )
        for row in table.rows
        if row.key and row.flag_name
    )


_GENERAL = "General arguments"
_HARDWARE = "Hardware selection arguments"
_RESOURCES = "Resource selection arguments"
_PARADIGM = "Training paradigm arguments"
_DISTRIBUTED = "Multi-process and multi-machine arguments (passed to torch.distributed.run)"
_DEEPSPEED = "DeepSpeed arguments"
_FSDP = "FSDP arguments"
_FP8 = "FP8 arguments"
_PARALLELISM = "N-D parallelism arguments (ParallelismConfig)"
_MPI = "MPI arguments"

FLAGS: tuple[Flag, ...] = (
    Flag("config_file", _GENERAL, "Launch config file to use (default: the file written by `hasten config`)."),
    Flag("quiet", _GENERAL, "Do not print the summary of the settings in force.", switch=True, short="-q"),
    Flag("module", _GENERAL, "Run the training script as a module (python -m).", switch=True, short="-m"),
    Flag("no_python", _GENERAL, "Run the training script as an executable, without `python`.", switch=True),
    Flag("debug", _GENERAL, "Check the inputs of every collective across processes, and report stuck ranks.", "debug", switch=True),
    Flag(
        "as_accelerate",
        _GENERAL,
        "Let every process import hasten as `accelerate` (for transformers, peft, diffusers, trl); also HASTEN_AS_ACCELERATE=1.",
        switch=True,
    ),
    Flag("cpu", _HARDWARE, "Train on the CPU even when GPUs are present.", "use_cpu", switch=True),
    Flag("multi_gpu", _HARDWARE, "Distributed training on several GPUs.", "distributed_type", switch=True, const="MULTI_GPU"),
    Flag("tpu", _HARDWARE, "TPU training (not supported by hasten).", "distributed_type", switch=True, const="XLA"),
    Flag("mixed_precision", _RESOURCES, "Mixed precision: no, fp16, bf16 or fp8.", "mixed_precision"),
    Flag("num_processes", _RESOURCES, "Total number of processes, across all machines.", "num_processes"),
    Flag("num_machines", _RESOURCES, "Number of machines taking part in the job.", "num_machines"),
    Flag("num_cpu_threads_per_process", _RESOURCES, "Threads per process (OMP_NUM_THREADS).", type=int, metavar="N"),
    Flag("enable_cpu_affinity", _RESOURCES, "Pin each process to the CPUs of its NUMA node.", "enable_cpu_affinity", switch=True),
    *_table_flags(DYNAMO, _RESOURCES),
    Flag("use_deepspeed", _PARADIGM, "Use DeepSpeed.", "distributed_type", switch=True, const="DEEPSPEED"),
    Flag("use_fsdp", _PARADIGM, "Use fully sharded data parallel (FSDP2).", "distributed_type", switch=True, const="FSDP"),
    Flag("use_megatron_lm", _PARADIGM, "Megatron-LM (not supported by hasten).", "distributed_type", switch=True, const="MEGATRON_LM"),
    Flag("gpu_ids", _DISTRIBUTED, "GPUs of this machine to use, e.g. 0,1 (default: all).", "gpu_ids"),
    Flag("same_network", _DISTRIBUTED, "All machines are on the same local network.", "same_network", switch=True),
    Flag("machine_rank", _DISTRIBUTED, "Rank of this machine (0 hosts the rendezvous).", "machine_rank"),
    Flag("main_process_ip", _DISTRIBUTED, "Address of machine rank 0 (required with several machines).", "main_process_ip"),
    Flag("main_process_port", _DISTRIBUTED, "Port of the rendezvous on machine rank 0 (default: a free port).", "main_process_port"),
    Flag("tee", _DISTRIBUTED, "Also write the processes' output to files: 0 none, 1 stdout, 2 stderr, 3 both.", short="-t"),
    Flag("log_dir", _DISTRIBUTED, "Folder for the processes' log files (with --tee)."),
    Flag("role", _DISTRIBUTED, "Role name of the workers."),
    Flag("rdzv_backend", _DISTRIBUTED, "Rendezvous backend: static (default) or c10d, etcd, etcd-v2.", "rdzv_backend"),
    Flag("rdzv_conf", _DISTRIBUTED, "Extra rendezvous settings, as key1=value1,key2=value2."),
    Flag("max_restarts", _DISTRIBUTED, "Restarts of the whole group of processes before giving up (default 0).", type=int, metavar="N"),
    Flag(
        "requeue_on_preemption",
        _DISTRIBUTED,
        "After SIGTERM/SIGUSR1 (preemption), run `scontrol requeue $SLURM_JOB_ID` (Slurm jobs).",
        switch=True,
    ),
    Flag("monitor_interval", _DISTRIBUTED, "Seconds between checks of the processes' state (default 0.1).", type=float, metavar="S"),
    *_table_flags(DEEPSPEED, _DEEPSPEED),
    *_table_flags(PARALLELISM, _PARALLELISM),
    *_table_flags(FSDP, _FSDP),
    *_table_flags(FP8, _FP8),
    Flag("mpirun_hostfile", _MPI, "Start the job with mpirun on the hosts of this file (CPU jobs).", "mpirun_config.mpirun_hostfile"),
)

_HARDWARE_SWITCHES = ("multi_gpu", "tpu", "use_deepspeed", "use_fsdp", "use_megatron_lm")


def _metavar(flag: Flag) -> str | None:
    if flag.metavar or flag.path is None:
        return flag.metavar
    choices = leaf_fields()[flag.path].get("choices")
    return "{" + ",".join(str(c).lower() if flag.path.startswith("dynamo") else str(c) for c in choices) + "}" if choices else None


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every launch flag (grouped) and the script positionals to ``parser``."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for flag in FLAGS:
        group = groups.get(flag.group) or groups.setdefault(flag.group, parser.add_argument_group(flag.group))
        names = [f"--{flag.name}"]
        if "_" in flag.name:
            names.append(f"--{flag.name.replace('_', '-')}")
        if flag.short:
            names.insert(0, flag.short)
        if flag.switch:
            group.add_argument(*names, dest=flag.name, action="store_const", const=flag.const, default=None, help=flag.help)
        else:
            group.add_argument(*names, dest=flag.name, default=None, type=flag.type, metavar=_metavar(flag), help=flag.help)
    parser.add_argument("training_script", help="The script (or module, with -m) to run in every process, followed by its arguments.")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)


def flag_settings(args: argparse.Namespace) -> dict[str, tuple[object, str]]:
    """Config settings given on the command line: dotted path -> (raw value, ``--flag``)."""
    given = [name for name in _HARDWARE_SWITCHES if getattr(args, name) is not None]
    if len(given) > 1 or (given and given[0] == "multi_gpu" and args.cpu):
        from ..errors import ConfigError

        chosen = given + (["cpu"] if args.cpu else [])
        raise ConfigError(f"Pass at most one of --cpu/--multi_gpu/--tpu/--use_deepspeed/--use_fsdp; got {', '.join('--' + n for n in chosen)}.")
    settings: dict[str, tuple[object, str]] = {}
    for flag in FLAGS:
        value = getattr(args, flag.name)
        if flag.path is not None and value is not None:
            settings[flag.path] = (value, f"--{flag.name}")
    return settings
