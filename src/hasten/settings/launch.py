"""The launch table: the config file's top-level keys and the other options of ``hasten launch``, one row each,
in the order of ``hasten launch -h`` (the keys without an option after them), and the ``mpirun_config`` table.

A row with a ``key`` is a field of the config file's ``ClusterConfig`` (its ``default`` when no source sets it);
a row with a variable is read by the processes (:func:`hasten.environment.launch_setting`); a row with neither is
an option of ``hasten launch`` alone. The engines' ``--use_<engine>`` switches and their sections come from
:mod:`hasten.settings.engines`.
"""

from __future__ import annotations

from ..enums import ComputeEnvironment, DistributedType, PrecisionType, member_values
from . import Question, Section, Setting

GENERAL = "General arguments"
HARDWARE = "Hardware selection arguments"
RESOURCES = "Resource selection arguments"
PARADIGM = "Training paradigm arguments"
DISTRIBUTED = "Multi-process and multi-machine arguments (passed to torch.distributed.run)"

RDZV_BACKENDS = ("static", "c10d", "etcd", "etcd-v2")


def _option(flag: str, group: str, help_text: str, kind: str = "str", **extra) -> Setting:
    """An option of ``hasten launch`` that is neither a config key nor a variable."""
    return Setting(None, kind, env=None, flag=flag, flag_help=help_text, group=group, **extra)


def _keyed(key: str, kind: str = "str", choices: tuple | None = None, **extra) -> Setting:
    """A top-level config key without a variable."""
    return Setting(key, kind, choices, env=None, **extra)


# The rows of the settings that code outside this package reads, writes, exports or checks, by name: everything that
# touches one of these settings goes through its row (its key, its variable, its choices, its default).
COMPUTE_ENVIRONMENT = _keyed(
    "compute_environment",
    "choice",
    tuple(member_values(ComputeEnvironment)),
    flag=None,
    default="LOCAL_MACHINE",
    question=Question("In which compute environment are you running?", "LOCAL_MACHINE"),
)

DISTRIBUTED_TYPE = _keyed(
    "distributed_type",
    "choice",
    tuple(member_values(DistributedType)),
    flag=None,
    default="NO",
    question=Question("Which type of machine are you using?", "NO"),
)

DEBUG = Setting(
    "debug",
    "bool",
    env="DEBUG_MODE",
    env_help="check every collective's inputs across ranks before running it",
    flag_help="Check the inputs of every collective across processes, and report stuck ranks.",
    switch=True,
    default=False,
    group=GENERAL,
    question=Question(
        "Should distributed operations be checked while running for errors? This can avoid timeout issues but will "
        "be slower."
    ),
)

AS_ACCELERATE = Setting(
    None,
    "bool",
    env="AS_ACCELERATE",
    default=False,
    flag="as_accelerate",
    switch=True,
    group=GENERAL,
    env_help="`hasten launch` makes its processes import hasten as `accelerate` (as --as_accelerate)",
    flag_help="Let every process import hasten as `accelerate` (for transformers, peft, diffusers, trl); "
    "also HASTEN_AS_ACCELERATE=1.",
)

USE_CPU = Setting(
    "use_cpu",
    "bool",
    env="USE_CPU",
    env_help="force the CPU even when an accelerator is present",
    flag="cpu",
    flag_help="Train on the CPU even when GPUs are present.",
    switch=True,
    flag_default=False,
    default=False,
    group=HARDWARE,
    question=Question("Do you want to run your training on CPU only (even if a GPU is available)?"),
)

MIXED_PRECISION = Setting(
    "mixed_precision",
    "choice",
    # PrecisionType's values, in the order of Accelerate's dialogue and help
    tuple(p.value for p in (PrecisionType.NO, PrecisionType.FP16, PrecisionType.BF16, PrecisionType.FP8)),
    env_help="default mixed precision: no, fp16, bf16 or fp8",
    flag_help="Mixed precision: no, fp16, bf16 or fp8.",
    default="no",
    group=RESOURCES,
    question=Question("Do you wish to use FP16 or BF16 (mixed precision)?", "no"),
)

NUM_PROCESSES = _keyed(
    "num_processes",
    "int",
    flag_help="Total number of processes, across all machines.",
    group=RESOURCES,
    question=Question("How many {devices} should be used for distributed training{where}?", 1),
)

NUM_MACHINES = _keyed(
    "num_machines",
    "int",
    flag_help="Number of machines taking part in the job.",
    default=1,
    group=RESOURCES,
    question=Question("How many different machines will you use (use more than 1 for multi-node training)?", 1),
)

ENABLE_CPU_AFFINITY = Setting(
    "enable_cpu_affinity",
    "bool",
    env="CPU_AFFINITY",
    env_help="pin each process to the CPUs of its NUMA node",
    flag_help="Pin each process to the CPUs of its NUMA node.",
    switch=True,
    flag_default=False,
    default=False,
    group=RESOURCES,
    question=Question("Would you like to enable numa efficiency? (Currently only supported on NVIDIA hardware)."),
)

GPU_IDS = _keyed(
    "gpu_ids",
    flag_help="GPUs of this machine to use, e.g. 0,1 (default: all).",
    group=DISTRIBUTED,
    question=Question(
        "What {devices} (by id) should be used for training on this machine as a comma-separated list?", "all"
    ),
)

SAME_NETWORK = _keyed(
    "same_network",
    "bool",
    flag_help="All machines are on the same local network.",
    switch=True,
    flag_default=False,
    default=False,
    group=DISTRIBUTED,
    question=Question(
        "Are all the machines on the same local network? Answer `no` if nodes are on the cloud and/or on different "
        "network hosts",
        True,
    ),
)

MACHINE_RANK = _keyed(
    "machine_rank",
    "int",
    flag_help="Rank of this machine (0 hosts the rendezvous).",
    default=0,
    group=DISTRIBUTED,
    question=Question("What is the rank of this machine?", 0),
)

MAIN_PROCESS_IP = _keyed(
    "main_process_ip",
    flag_help="Address of machine rank 0 (required with several machines).",
    group=DISTRIBUTED,
    question=Question("What is the IP address of the machine that will host the main process?", None),
)

MAIN_PROCESS_PORT = _keyed(
    "main_process_port",
    "int",
    flag_help="Port of the rendezvous on machine rank 0 (default: a free port).",
    group=DISTRIBUTED,
    question=Question("What is the port you will use to communicate with the main process?", 29500),
)

RDZV_BACKEND = _keyed(
    "rdzv_backend",
    "choice",
    RDZV_BACKENDS,
    flag_help="Rendezvous backend: static (default) or c10d, etcd, etcd-v2.",
    default="static",
    flag_default="static",
    group=DISTRIBUTED,
    question=Question("What rendezvous backend will you use?", "static"),
)

_GENERAL_ROWS = (
    COMPUTE_ENVIRONMENT,
    DISTRIBUTED_TYPE,
    _option(
        "config_file",
        GENERAL,
        "Launch config file to use (default: $HASTEN_CONFIG_FILE, else the file written by the `config` command: "
        "hasten's, or Accelerate's under the accelerate command).",
    ),
    _option("quiet", GENERAL, "Do not print the summary of the settings in force.", switch=True, short="-q"),
    _option("module", GENERAL, "Run the training script as a module (python -m).", switch=True, short="-m"),
    _option("no_python", GENERAL, "Run the training script as an executable, without `python`.", switch=True),
    DEBUG,
    AS_ACCELERATE,
)
_HARDWARE_ROWS = (
    USE_CPU,
    _option("multi_gpu", HARDWARE, "Distributed training on several GPUs.", switch=True, chooses="MULTI_GPU"),
    _option("tpu", HARDWARE, "TPU training (not supported by hasten).", switch=True, chooses="XLA"),
)
_RESOURCE_ROWS = (
    MIXED_PRECISION,
    NUM_PROCESSES,
    NUM_MACHINES,
    _option("num_cpu_threads_per_process", RESOURCES, "Threads per process (OMP_NUM_THREADS).", "int", metavar="N"),
    ENABLE_CPU_AFFINITY,
)
_PARADIGM_ROWS = (
    _option("use_megatron_lm", PARADIGM, "Megatron-LM (not supported by hasten).", switch=True, chooses="MEGATRON_LM"),
)
_DISTRIBUTED_ROWS = (
    GPU_IDS,
    SAME_NETWORK,
    MACHINE_RANK,
    MAIN_PROCESS_IP,
    MAIN_PROCESS_PORT,
    _option(
        "tee",
        DISTRIBUTED,
        "Also write the processes' output to files: 0 none, 1 stdout, 2 stderr, 3 both.",
        short="-t",
        flag_default="0",
    ),
    _option("log_dir", DISTRIBUTED, "Folder for the processes' log files (with --tee)."),
    _option("role", DISTRIBUTED, "Role name of the workers.", flag_default="default"),
    RDZV_BACKEND,
    _option("rdzv_conf", DISTRIBUTED, "Extra rendezvous settings, as key1=value1,key2=value2.", flag_default=""),
    _option(
        "max_restarts",
        DISTRIBUTED,
        "Restarts of the whole group of processes before giving up (default 0).",
        "int",
        metavar="N",
        flag_default=0,
    ),
    _option(
        "requeue_on_preemption",
        DISTRIBUTED,
        "After SIGTERM/SIGUSR1 (preemption), run `scontrol requeue $SLURM_JOB_ID` (Slurm jobs).",
        switch=True,
    ),
    _option(
        "monitor_interval",
        DISTRIBUTED,
        "Seconds between checks of the processes' state (default 0.1).",
        "float",
        metavar="S",
        flag_default=0.1,
    ),
)
_FILE_ONLY_ROWS = (
    _keyed("main_training_function", flag=None, default="main"),
    _keyed("downcast_bf16", "bool", flag=None, default=False),
    _keyed("tpu_name", flag=None),
    _keyed("tpu_zone", flag=None),
    _keyed("tpu_use_cluster", "bool", flag=None, default=False),
    _keyed("tpu_use_sudo", "bool", flag=None, default=False),
    _keyed("command_file", flag=None),
    _keyed("commands", "list", flag=None),
    _keyed("tpu_vm", "list", flag=None),
    _keyed("tpu_env", "list", flag=None),
)

LAUNCH = Section(
    name="",
    class_name="ClusterConfig",
    doc="The top-level keys of a launch config file and the options of ``hasten launch``.",
    rows=(*_GENERAL_ROWS, *_HARDWARE_ROWS, *_RESOURCE_ROWS, *_PARADIGM_ROWS, *_DISTRIBUTED_ROWS, *_FILE_ONLY_ROWS),
)

MPIRUN = Section(
    name="mpirun_config",
    class_name="MpirunSection",
    doc="``mpirun_config``: start the processes of a multi-machine CPU job with ``mpirun``.",
    group="MPI arguments",
    rows=(
        Setting(
            "mpirun_hostfile",
            env=None,
            flag_help="Start the job with mpirun on the hosts of this file (CPU jobs).",
            question=Question("Please enter the path to the hostfile to use with mpirun", "~/hostfile"),
        ),
    ),
)
