"""Reads the world: launcher variables, ``HASTEN_*`` settings, devices and the operating system.

This is the only module that reads ``os.environ`` for settings. Every variable hasten reads is listed
in :data:`SETTINGS` with its meaning; ``HASTEN_<NAME>`` wins, ``ACCELERATE_<NAME>`` is accepted as a
fallback so that scripts and job files written for Accelerate keep working. Reading a name that is
not listed is a programming error (``KeyError``), which keeps the list complete.
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from .accelerate_alias import logger_for
from .errors import ConfigError, DistributedSetupError
from .settings import Setting
from .settings.dynamo import DYNAMO
from .settings.engines import BUILT_IN, Engine, load_engines
from .settings.fp8 import FP8
from .settings.launch import LAUNCH
from .settings.values import str_to_bool

# The engines hasten can run: the built-in registrations, then the modules named by HASTEN_ENGINES.
ENGINES: tuple[Engine, ...] = load_engines((*BUILT_IN, *os.environ.get("HASTEN_ENGINES", "").split(",")))


def _engine_variables() -> dict[str, str]:
    """The variables of the registered engines: switch, sections' rows, others."""
    found: dict[str, str] = {}
    for engine in ENGINES:
        if engine.switch:
            found[engine.switch] = engine.switch_help
        for section in engine.sections:
            found |= section.env_help()
        found |= engine.variables
    return found


# name (without prefix) -> meaning. Read as HASTEN_<name>, then ACCELERATE_<name>, then the extra aliases.
# The launch settings come from their rows in hasten.settings (the engines' from their registrations).
SETTINGS: dict[str, str] = {
    **LAUNCH.env_help(),
    "HANG_TIMEOUT": (
        "seconds a rank may wait in any collective before the job ends with a hang report (default: the "
        "InitProcessGroupKwargs timeout, else 300; 0 turns it off)"
    ),
    "HANG_REPORT_DIR": "folder where the rank that reports a hang writes hang_rank<N>.json for the launcher",
    "LOG_LEVEL": "default level of loggers made by hasten.logging.get_logger",
    "TORCH_DEVICE": "override the device string of every process (e.g. cuda:1)",
    **DYNAMO.env_help(),
    **_engine_variables(),
    **FP8.env_help(),
    "BYPASS_DEVICE_MAP": "let prepare() accept a model dispatched with a device_map",
    "INIT_INCLUDE_BUFFERS": "default include_buffers of init_empty_weights",
    "HOME": "folder of the default launch config file",
    "CONFIG_FILE": (
        "launch config file that `hasten launch`, `hasten config`, `env` and `test` use when --config_file is not "
        "given (before the default file)"
    ),
    "LAUNCHED": "set by `hasten launch` in the processes it starts",
    "LAUNCH_SOURCES": "JSON of where each launch setting came from (set by `hasten launch`)",
    "ENABLE_RICH": "accepted for compatibility; has no effect",
    "PREEMPTION_GRACE": (
        "seconds workers get after SIGTERM/SIGUSR1 to finish the step and save before they are killed (default 25)"
    ),
    "PREEMPTION_DIR": "folder where rank 0 records a preemption checkpoint for the launcher (set by `hasten launch`)",
    "ENGINES": "comma-separated modules registering more engines (hasten.settings.engines), read once per process",
}

# Settings that Accelerate reads without a prefix, accepted as a last fallback.
_BARE_ALIASES = {name: name for name in SETTINGS if name.startswith(("FSDP_", "PARALLELISM_CONFIG_"))}


def _lookup(name: str) -> tuple[str, str] | None:
    """Return (variable, value) for a listed setting, or None when it is unset."""
    if name not in SETTINGS:
        raise KeyError(f"hasten.environment: {name!r} is not listed in SETTINGS")
    candidates = [f"HASTEN_{name}", f"ACCELERATE_{name}"]
    if name in _BARE_ALIASES:
        candidates.append(_BARE_ALIASES[name])
    for var in candidates:
        value = os.environ.get(var)
        if value is not None:
            return var, value
    return None


def setting_source(name: str) -> str | None:
    """Name of the environment variable that provides setting ``name``, or None if unset."""
    found = _lookup(name)
    return found[0] if found else None


def get_str(name: str, default: str | None = None) -> str | None:
    """Read a listed setting as a string."""
    found = _lookup(name)
    return found[1] if found else default


def get_flag(name: str, default: bool = False) -> bool:
    """Read a listed setting as a boolean; an unparsable value names the variable."""
    found = _lookup(name)
    if found is None:
        return default
    var, value = found
    try:
        return bool(str_to_bool(value))
    except ConfigError:
        raise ConfigError(
            f"Environment variable {var}={value!r} is not a boolean; use 1/0, true/false or yes/no."
        ) from None


def get_int(name: str, default: int | None = None) -> int | None:
    """Read a listed setting as an integer; an unparsable value names the variable."""
    found = _lookup(name)
    if found is None or found[1] == "":
        return default
    var, value = found
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"Environment variable {var}={value!r} is not an integer.") from None


def get_float(name: str, default: float | None = None) -> float | None:
    """Read a listed setting as a float; an unparsable value names the variable."""
    found = _lookup(name)
    if found is None or found[1] == "":
        return default
    var, value = found
    try:
        return float(value)
    except ValueError:
        raise ConfigError(f"Environment variable {var}={value!r} is not a number.") from None


def read_setting(row: Setting) -> Any:
    """The value of a table row's variable, typed by the row's kind: a boolean (as :func:`get_flag`), an integer
    (as :func:`get_int`) or the text; None when unset. An empty variable counts as unset, except for a boolean."""
    found = _lookup(row.env_name)
    if found is None:
        return None
    if row.kind == "bool":
        return get_flag(row.env_name)
    if found[1] == "":
        return None
    if row.kind == "int" or (row.choices and isinstance(row.choices[0], int)):
        return get_int(row.env_name)
    return found[1]


def launch_setting(key: str) -> Any:
    """The launch table's top-level setting ``key`` in this process: its variable (written by ``hasten launch``),
    typed as :func:`read_setting` types it, else the key's default (``launch_setting("use_cpu")``)."""
    row = LAUNCH.by_key(key)
    value = read_setting(row)
    return row.default if value is None else value


def any_set(rows: Iterable[Setting]) -> bool:
    """Whether the variable of any of ``rows`` that fill a plugin field is set."""
    return any(setting_source(row.env_name) for row in rows if row.field)


def fill_unset(obj: Any, rows: Iterable[Setting], fields: Iterable[str] | None = None) -> set[str]:
    """Fill every field of ``obj`` still None from its row: the row's variable, else its fallback.

    Only rows with a ``field`` (and, with ``fields``, only those fields) take part. Returns the fields
    set from a variable, so that the caller can tell them from its arguments.
    """
    from_env: set[str] = set()
    for row in rows:
        if row.field is None or (fields is not None and row.field not in fields) or getattr(obj, row.field) is not None:
            continue
        value = read_setting(row)
        if value is not None:
            from_env.add(row.field)
        setattr(obj, row.field, row.fallback if value is None else value)
    return from_env


# --------------------------------------------------------------- any variable (Accelerate's helpers)


def parse_flag_from_env(key: str, default: bool = False) -> bool:
    """Read an arbitrary environment variable as a boolean (Accelerate's helper; hasten's own settings use
    :func:`get_flag`)."""
    value = os.environ.get(key)
    return default if value is None else bool(str_to_bool(value))


def parse_choice_from_env(key: str, default: str = "no") -> str:
    """Read an arbitrary environment variable as a string, with a default."""
    return os.environ.get(key, str(default))


def get_int_from_env(env_keys: list[str], default: int) -> int:
    """The first non-negative integer found among ``env_keys``, else ``default``."""
    for key in env_keys:
        value = int(os.environ.get(key, -1))
        if value >= 0:
            return value
    return default


# ----------------------------------------------------------------------------------- launch context


@dataclass(frozen=True)
class LaunchInfo:
    """Where this process sits in the job, as told by its launcher.

    ``source`` is ``"torchrun"`` (torch elastic, ``hasten launch``), ``"mpi"``, ``"slurm"`` or
    ``"none"`` (a plain ``python script.py``).
    """

    source: str
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: str | None = None
    master_port: int | None = None

    @property
    def node_rank(self) -> int:
        """Index of this machine, assuming the same number of processes on every machine."""
        return self.rank // max(self.local_world_size, 1)

    @property
    def num_nodes(self) -> int:
        """Number of machines, assuming the same number of processes on every machine."""
        return max(self.world_size // max(self.local_world_size, 1), 1)


def _int_env(*names: str) -> int | None:
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError:
                raise DistributedSetupError(f"Launcher variable {name}={value!r} is not an integer.") from None
    return None


def _master_address(default: str | None) -> tuple[str | None, int | None]:
    return os.environ.get("MASTER_ADDR", default), _int_env("MASTER_PORT")


def _from_torchrun() -> LaunchInfo | None:
    rank, world = _int_env("RANK"), _int_env("WORLD_SIZE")
    local_rank = _int_env("LOCAL_RANK")
    if rank is None and local_rank is None:
        return None
    rank = rank if rank is not None else local_rank
    world = world if world is not None else 1
    local_rank = local_rank if local_rank is not None else rank
    local_world = _int_env("LOCAL_WORLD_SIZE") or world
    addr, port = _master_address(None)
    return LaunchInfo("torchrun", rank, world, local_rank, local_world, addr, port)


def _from_mpi() -> LaunchInfo | None:
    # Open MPI, then MPICH/Intel MPI (PMI), then PMIx, then MVAPICH2.
    rank = _int_env("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")
    world = _int_env("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MV2_COMM_WORLD_SIZE")
    if rank is None or world is None:
        return None
    local_rank = _int_env(
        "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMIX_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_RANK"
    )
    local_world = _int_env(
        "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "PMIX_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE"
    )
    local_world = local_world if local_world is not None else world
    local_rank = local_rank if local_rank is not None else rank % local_world
    addr, port = _master_address("127.0.0.1" if local_world == world else None)
    if addr is None:
        raise DistributedSetupError(
            f"MPI launch across machines detected (world size {world}, {local_world} per machine) but MASTER_ADDR "
            "is not set. Export MASTER_ADDR=<address of rank 0's machine> (and MASTER_PORT) to every rank, "
            "e.g. mpirun -x MASTER_ADDR=10.0.0.1 -x MASTER_PORT=29500 ..."
        )
    return LaunchInfo("mpi", rank, world, local_rank, local_world, addr, port or 29500)


def _from_slurm() -> LaunchInfo | None:
    # Only an srun job step (SLURM_STEP_ID set) with several tasks is a distributed launch: a batch script
    # that runs `python train.py` once also sees SLURM_PROCID=0 but must stay a single process.
    rank, world = _int_env("SLURM_PROCID"), _int_env("SLURM_NTASKS")
    if rank is None or world is None or world < 2 or os.environ.get("SLURM_STEP_ID") is None:
        return None
    local_rank = _int_env("SLURM_LOCALID") or 0
    local_world = _tasks_on_this_node() or world
    addr, port = _master_address(None)
    if addr is None:
        nodes = parse_slurm_nodelist(os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST", ""))
        addr = nodes[0] if nodes else "127.0.0.1"
    if port is None:
        job_id = _int_env("SLURM_JOB_ID") or 0
        port = 20000 + job_id % 10000  # the same on every node of the job, different between jobs
    return LaunchInfo("slurm", rank, world, local_rank, local_world, addr, port)


def _tasks_on_this_node() -> int | None:
    raw = os.environ.get("SLURM_STEP_TASKS_PER_NODE") or os.environ.get("SLURM_TASKS_PER_NODE")
    node_id = _int_env("SLURM_NODEID") or 0
    if not raw:
        return None
    counts: list[int] = []
    for part in raw.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            return None
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts[node_id] if node_id < len(counts) else counts[-1]


def parse_slurm_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm node list such as ``"gpu[01-03,07],cpu5"`` into host names."""
    hosts: list[str] = []
    for match in re.finditer(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist):
        prefix, ranges = match.group(1), match.group(2)
        if not ranges:
            hosts.append(prefix)
            continue
        for item in ranges.split(","):
            if "-" in item:
                lo, hi = item.split("-", 1)
                hosts += [f"{prefix}{i:0{len(lo)}d}" for i in range(int(lo), int(hi) + 1)]
            else:
                hosts.append(f"{prefix}{item}")
    return hosts


def detect_launch() -> LaunchInfo:
    """Find out how this process was launched: torchrun/elastic, MPI, Slurm, or not at all."""
    for probe in (_from_torchrun, _from_mpi, _from_slurm):
        info = probe()
        if info is not None:
            return info
    return LaunchInfo("none")


def export_for_torch(info: LaunchInfo) -> None:
    """Write the torch.distributed variables for a process started by MPI or Slurm.

    ``init_process_group(init_method="env://")`` and libraries such as DeepSpeed read these.
    """
    values = {
        "RANK": info.rank,
        "WORLD_SIZE": info.world_size,
        "LOCAL_RANK": info.local_rank,
        "LOCAL_WORLD_SIZE": info.local_world_size,
        "MASTER_ADDR": info.master_addr or "127.0.0.1",
        "MASTER_PORT": info.master_port or 29500,
    }
    for key, value in values.items():
        os.environ.setdefault(key, str(value))


# ------------------------------------------------------------------------------------------ devices


def accelerator_type() -> str:
    """The accelerator family present: ``"cuda"``, ``"xpu"``, ``"mps"`` or ``"cpu"``."""
    import torch

    if torch.cuda.is_available():
        return "cuda"
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return "xpu"
    if hasattr(torch.backends, "mps") and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def device_count(kind: str) -> int:
    """Number of devices of family ``kind`` visible to this process."""
    import torch

    if kind == "cuda":
        return torch.cuda.device_count()
    if kind == "xpu":
        return torch.xpu.device_count()
    return 1


def select_device(cpu: bool, local_rank: int):
    """The device this process should use: an override, then ``<accelerator>:<local_rank>``, then CPU."""
    import torch

    override = get_str("TORCH_DEVICE")
    if override:
        return torch.device(override)
    kind = "cpu" if cpu else accelerator_type()
    if kind in ("cuda", "xpu"):
        count = device_count(kind)
        if local_rank >= count:
            raise DistributedSetupError(
                f"This process has local rank {local_rank} but only {count} {kind.upper()} device(s) are visible. "
                f"Start at most {count} process(es) per machine (--num_processes), or check CUDA_VISIBLE_DEVICES / "
                "--gpu_ids."
            )
        return torch.device(kind, local_rank)
    return torch.device(kind)


# -------------------------------------------------------------------------------- operating system


def kernel_version() -> tuple[int, ...] | None:
    """The Linux kernel version as a tuple, or None on other systems."""
    if platform.system() != "Linux":
        return None
    match = re.match(r"(\d+)\.(\d+)", platform.release())
    return (int(match.group(1)), int(match.group(2))) if match else None


_kernel_warned = False


def check_os_kernel() -> None:
    """Log a warning once when the Linux kernel is older than 5.5, where processes are known to hang (on
    Accelerate's logger ``accelerate.utils.environment`` under the alias, else ``hasten.utils.environment``)."""
    global _kernel_warned
    version = kernel_version()
    if _kernel_warned or version is None or version >= (5, 5):
        return
    _kernel_warned = True
    logger_for("utils.environment").warning(
        f"Detected Linux kernel {platform.release()}, older than the minimum recommended 5.5.0: distributed jobs "
        "are known to hang on such kernels. Upgrade the kernel if processes stall."
    )


def config_home() -> Path:
    """Folder of the default launch config file.

    ``$HASTEN_HOME``, then ``$HF_HOME/hasten``, then ``$XDG_CACHE_HOME/huggingface/hasten``, then
    ``~/.cache/huggingface/hasten``.
    """
    explicit = os.environ.get("HASTEN_HOME")
    if explicit:
        return Path(explicit).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hasten"
    cache = os.environ.get("XDG_CACHE_HOME")
    base = Path(cache).expanduser() if cache else Path.home() / ".cache"
    return base / "huggingface" / "hasten"


def default_config_file() -> Path:
    """Path of ``default_config.yaml`` in :func:`config_home`."""
    return config_home() / "default_config.yaml"


def torch_extensions_dir() -> Path:
    """The folder where torch builds and finds JIT-compiled extensions (DeepSpeed's ops) in processes started from this
    one: ``$TORCH_EXTENSIONS_DIR`` (the venv ``make`` builds sets it to its own ``torch_extensions`` folder), else
    torch's default, ``~/.cache/torch_extensions/py<version>_<cpu or cuXYZ>`` (imports torch)."""
    explicit = os.environ.get("TORCH_EXTENSIONS_DIR")
    if explicit:
        return Path(explicit).expanduser()
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    build = "cpu" if torch.version.cuda is None else f"cu{torch.version.cuda.replace('.', '')}"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{python}_{build}"


def accelerate_config_home() -> Path:
    """Folder of Accelerate's default launch config file, found as Accelerate 1.15 finds it: ``$HF_HOME/accelerate``,
    else ``$XDG_CACHE_HOME/huggingface/accelerate``, else ``~/.cache/huggingface/accelerate``."""
    hf_home = os.environ.get("HF_HOME")
    if not hf_home:
        cache = os.environ.get("XDG_CACHE_HOME")
        hf_home = os.path.join(cache or "~/.cache", "huggingface")
    return Path(hf_home).expanduser() / "accelerate"


# ------------------------------------------------------------------------------- env manipulation


@contextlib.contextmanager
def patch_environment(**kwargs):
    """Set environment variables (keys upper-cased) for the duration of the block, then restore them."""
    saved = {}
    for key, value in kwargs.items():
        key = key.upper()
        saved[key] = os.environ.get(key)
        os.environ[key] = str(value)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


@contextlib.contextmanager
def clear_environment():
    """Empty ``os.environ`` for the duration of the block, then restore it exactly."""
    saved = dict(os.environ)
    os.environ.clear()
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


_LAUNCH_PREFIXES = ("ACCELERATE_", "HASTEN_")


@contextlib.contextmanager
def _restored_launch_variables():
    saved = {k: v for k, v in os.environ.items() if k.startswith(_LAUNCH_PREFIXES)}
    try:
        yield
    finally:
        for key in [k for k in os.environ if k.startswith(_LAUNCH_PREFIXES)]:
            if key not in saved:
                del os.environ[key]
        os.environ.update(saved)


def purge_accelerate_environment(func_or_cls):
    """Decorator: ``ACCELERATE_*`` and ``HASTEN_*`` variables set while the function (or each ``test*`` method of
    the class and of its subclasses) runs are removed afterwards, and changed ones restored.

    Objects such as transformers' ``TrainingArguments(fp16=True)`` export ``ACCELERATE_MIXED_PRECISION``; in a
    test suite that would leak into the next test.
    """

    def wrap(function):
        if getattr(function, "_hasten_purges_environment", False):
            return function

        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            with _restored_launch_variables():
                return function(*args, **kwargs)

        wrapper._hasten_purges_environment = True
        return wrapper

    def wrap_tests(cls):
        for name in dir(cls):
            if name.startswith("test") and callable(getattr(cls, name)):
                setattr(cls, name, wrap(getattr(cls, name)))
        return cls

    if not isinstance(func_or_cls, type):
        return wrap(func_or_cls)
    original = func_or_cls.__init_subclass__

    def init_subclass(cls, **kwargs):
        if hasattr(original, "__func__"):  # the class's own __init_subclass__
            original.__func__(cls, **kwargs)
        else:
            original(**kwargs)
        wrap_tests(cls)

    func_or_cls.__init_subclass__ = classmethod(init_subclass)
    return wrap_tests(func_or_cls)


def convert_dict_to_env_variables(current_env: dict) -> list[str]:
    """``KEY=value\\n`` lines for an environment file, leaving out (with a warning) entries that are empty or hold a
    character that would break the file (``;``, a newline, ``<``, ``>`` or a space); each is logged as a warning on
    the logger of ``utils.environment`` (see :func:`hasten.accelerate_alias.logger_for`)."""
    lines = []
    for key, value in current_env.items():
        text = f"{key}{value}"
        if key and value and not any(char in text for char in ";\n<> "):
            lines.append(f"{key}={value}\n")
        else:
            logger_for("utils.environment").warning(
                f"Skipping the environment variable {key}={value!r}: it is empty or holds a forbidden character."
            )
    return lines
