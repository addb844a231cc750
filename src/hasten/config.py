"""The launch config file: schema, validated loading, migration of old files, writing, and the one
merge of command-line flags, config file, environment and defaults that ``hasten launch`` uses.

The keys are Accelerate's, so a file written by ``accelerate config`` loads unchanged; files written
by older Accelerate versions (``fp16: true``, a top-level ``dynamo_backend``, ``ipex_config``, ...) are
migrated on read, and ``hasten config update`` rewrites them. Every key and value is checked: a
problem is a :class:`~hasten.errors.ConfigError` that names the file, the (dotted) key, the allowed
values and the closest valid key.

``ClusterConfig`` is generated from the tables of :mod:`hasten.settings`: its top-level keys from the launch
table (:mod:`hasten.settings.launch`), its sections from ``dynamo_config``, the registered engines' sections
(``deepspeed_config``, ``parallelism_config``, ``fsdp_config``, ...), ``fp8_config`` and ``mpirun_config``; the
tables also give the variables each setting travels in. Values are checked by :mod:`hasten.settings.values`,
old files rewritten by :mod:`hasten.settings.migrate`.

Example::

    from hasten.config import load_config_file, write_basic_config

    path = write_basic_config(mixed_precision="bf16")
    config = load_config_file(path)
    config.deepspeed_config.zero_stage   # None: not set in this file
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from . import environment
from .enums import ComputeEnvironment, DistributedType, member_values
from .errors import ConfigError, did_you_mean
from .runtime.fileio import atomic_write
from .settings import Section, Setting, prefixed
from .settings.command import command_name

# hasten.config's names of choices that compat.constants reads: DEEPSPEED_MULTINODE_LAUNCHERS, FSDP_*, RDZV_BACKENDS
from .settings.deepspeed import DEEPSPEED_MULTINODE_LAUNCHERS  # noqa: F401
from .settings.dynamo import DYNAMO
from .settings.file_text import read_config_data
from .settings.fp8 import FP8
from .settings.fsdp import (  # noqa: F401
    FSDP_AUTO_WRAP_POLICIES,
    FSDP_BACKWARD_PREFETCH,
    FSDP_SHARDING_STRATEGIES,
    FSDP_STATE_DICT_TYPES,
)
from .settings.launch import (  # noqa: F401
    COMPUTE_ENVIRONMENT,
    DEBUG,
    DISTRIBUTED_TYPE,
    LAUNCH,
    MIXED_PRECISION,
    MPIRUN,
    NUM_PROCESSES,
    RDZV_BACKENDS,
    USE_CPU,
)
from .settings.migrate import migrate as _migrate
from .settings.sagemaker import REQUIRED as _SAGEMAKER_REQUIRED
from .settings.sagemaker import SAGEMAKER
from .settings.values import Invalid as _Invalid
from .settings.values import as_choice as _as_choice
from .settings.values import convert as _convert

_GPU_TYPES = (DistributedType.MULTI_GPU.value, DistributedType.MULTI_XPU.value)
# The distributed types a file may name: Accelerate's, and those of the engines registered beyond them.
DISTRIBUTED_TYPES = (
    *member_values(DistributedType),
    *(k for engine in environment.ENGINES for k in engine.distributed_types if k not in member_values(DistributedType)),
)


def _opt(default: Any = None, kind: str = "str", choices: tuple | list | None = None) -> Any:
    """A config field: ``kind`` is bool, int, float, float_or_auto, str, list, choice, bool3 or any."""
    return field(default=default, metadata={"kind": kind, "choices": tuple(choices) if choices else None})


def _section(cls: type) -> Any:
    return field(default_factory=cls, metadata={"kind": "section", "cls": cls})


def _row_field(row: Setting, default: Any = None) -> tuple:
    choices = DISTRIBUTED_TYPES if row is DISTRIBUTED_TYPE else row.choices
    return (row.key, Any, _opt(default, row.kind, choices))


def _section_class(section: Section) -> type:
    """The config file section dataclass of a settings table: a field per row with a config key, None (not set)."""
    fields = [_row_field(row) for row in section.rows if row.key]
    cls = dataclasses.make_dataclass(section.class_name, fields, kw_only=True, slots=True)
    cls.__module__, cls.__doc__ = __name__, section.doc
    return cls


# The sections of a launch config file: torch.compile's, the registered engines', fp8's and mpirun's.
SECTIONS: tuple[Section, ...] = (DYNAMO, *(s for engine in environment.ENGINES for s in engine.sections), FP8, MPIRUN)
SECTION_CLASSES: dict[str, type] = {section.name: _section_class(section) for section in SECTIONS}
DynamoSection = SECTION_CLASSES[DYNAMO.name]


def _to_dict(self) -> dict:
    """The config as plain data (see :func:`config_to_dict`), as Accelerate's config objects give it."""
    return config_to_dict(self)


# The rows of the keys every config has, whatever its compute environment (Accelerate's ``BaseConfig``).
BASE_ROWS = (COMPUTE_ENVIRONMENT, DISTRIBUTED_TYPE, MIXED_PRECISION, USE_CPU, DEBUG)


def _base_config() -> type:
    """``BaseConfig``: a field per row of :data:`BASE_ROWS` (its default)."""
    fields = [_row_field(row, row.default) for row in BASE_ROWS]
    cls = dataclasses.make_dataclass("BaseConfig", fields, kw_only=True, slots=True, namespace={"to_dict": _to_dict})
    cls.__module__ = __name__
    cls.__doc__ = """The keys of every launch config (``compute_environment``, ``distributed_type``,
    ``mixed_precision``, ``use_cpu``, ``debug``): the base of :class:`ClusterConfig` and :class:`SageMakerConfig`,
    as in Accelerate."""
    return cls


BaseConfig = _base_config()


def _cluster_config() -> type:
    """``ClusterConfig``: :class:`BaseConfig`, a field per other top-level key of the launch table (its default), then a
    field per section."""
    fields = [_row_field(row, row.default) for row in LAUNCH.rows if row.key and row not in BASE_ROWS]
    fields += [(name, Any, _section(cls)) for name, cls in SECTION_CLASSES.items()]
    megatron = field(default_factory=dict, metadata={"kind": "prefixed", "prefix": "megatron_lm_"})
    fields.append(("megatron_lm_config", dict, megatron))
    cls = dataclasses.make_dataclass(
        "ClusterConfig", fields, bases=(BaseConfig,), kw_only=True, slots=True, namespace={"to_dict": _to_dict}
    )
    cls.__module__ = __name__
    cls.__doc__ = """A launch config for jobs on this machine or a cluster (``compute_environment: LOCAL_MACHINE``).

    One field per top-level key of :data:`hasten.settings.launch.LAUNCH` and per section (the engines' sections come
    from their registrations). Section fields left at None are "not set": the strategy decides. ``num_processes`` is
    the total number of processes across all machines, as in Accelerate.
    """
    return cls


ClusterConfig = _cluster_config()


def _sagemaker_config() -> type:
    """``SageMakerConfig``: :class:`BaseConfig`, a field per row of the SageMaker table (its default), then
    ``dynamo_config``."""
    fields = [_row_field(row, row.default) for row in SAGEMAKER.rows]
    fields.append(("dynamo_config", Any, _section(DynamoSection)))
    cls = dataclasses.make_dataclass(
        SAGEMAKER.class_name, fields, bases=(BaseConfig,), kw_only=True, slots=True, namespace={"to_dict": _to_dict}
    )
    cls.__module__, cls.__doc__ = __name__, SAGEMAKER.doc
    return cls


SageMakerConfig = _sagemaker_config()


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _build(cls: type, data: dict, prefix: str, errors: list[str], present: set[str]) -> Any:
    """Instantiate ``cls`` from ``data``, appending a line to ``errors`` for every bad key or value."""
    known = _fields(cls)
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in known:
            where = f" in {prefix[:-1]}" if prefix else ""
            errors.append(
                f"unknown key {dotted!r}.{did_you_mean(str(key), known)} Allowed keys{where}: {', '.join(known)}."
            )
            continue
        meta = known[key].metadata
        if meta["kind"] == "section":
            if value is None:
                continue
            if not isinstance(value, dict):
                errors.append(f"{dotted!r} must be a mapping of keys to values, got {value!r}.")
                continue
            kwargs[key] = _build(meta["cls"], value, f"{dotted}.", errors, present)
        elif meta["kind"] == "prefixed":
            kwargs[key] = _check_prefixed(value, dotted, meta["prefix"], errors, present)
        elif value is not None:
            try:
                kwargs[key] = _convert(value, meta)
                present.add(dotted)
            except _Invalid as exc:
                errors.append(f"{dotted}: {value!r} is not valid; {exc}")
    return cls(**kwargs)


def _check_prefixed(value: Any, dotted: str, prefix: str, errors: list[str], present: set[str]) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        errors.append(f"{dotted!r} must be a mapping of keys to values, got {value!r}.")
        return {}
    for key in value:
        if not str(key).startswith(prefix):
            errors.append(f"unknown key '{dotted}.{key}': keys of {dotted} start with {prefix!r}.")
    if value:
        present.add(dotted)
    return dict(value)


# ------------------------------------------------------------------------------ load / save


@dataclass(kw_only=True, slots=True)
class LoadedConfig:
    """A config file as read: the validated config, the dotted keys the file sets, and migration notes."""

    config: ClusterConfig | SageMakerConfig
    path: Path
    present: frozenset[str]
    notes: list[str]


def config_from_dict(
    data: dict, source: str = "<dict>"
) -> tuple[ClusterConfig | SageMakerConfig, frozenset[str], list[str]]:
    """Validate a config mapping; returns (config, dotted keys present, migration notes).

    Raises:
        ConfigError: naming ``source``, every bad key (with the closest valid one) and bad value.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"Launch config {source} must be a mapping of keys to values, got {type(data).__name__}.")
    data = json.loads(json.dumps(data, default=str))  # a deep copy that _migrate may edit
    notes = _migrate(data)
    environment_value = str(data.get("compute_environment", ComputeEnvironment.LOCAL_MACHINE.value)).upper()
    cls = SageMakerConfig if environment_value == ComputeEnvironment.AMAZON_SAGEMAKER.value else ClusterConfig
    errors: list[str] = []
    present: set[str] = set()
    config = _build(cls, data, "", errors, present)
    if cls is SageMakerConfig:
        errors += [
            f"missing key {row.key!r} (required for SageMaker)" for row in _SAGEMAKER_REQUIRED if row.key not in present
        ]
    if errors:
        lines = "\n".join(f"  - {line}" for line in errors)
        raise ConfigError(
            f"Invalid launch config {source}:\n{lines}\nFix these entries, or write a new file with "
            f"`{command_name()} config`."
        )
    return config, frozenset(present), notes


def read_config_file(path: str | os.PathLike) -> LoadedConfig:
    """Load and validate a YAML (or ``.json``) launch config file, keeping which keys it sets.

    Raises:
        ConfigError: the file is missing, unparsable, or has an unknown key or a bad value.
    """
    path = Path(path).expanduser()
    data = read_config_data(path)
    config, present, notes = config_from_dict(data, str(path))
    return LoadedConfig(config=config, path=path, present=present, notes=notes)


def load_config_file(path: str | os.PathLike | None = None) -> ClusterConfig | SageMakerConfig:
    """Load and validate a launch config file (default: :func:`default_config_file`)."""
    return read_config_file(path or environment.default_config_file()).config


def config_to_dict(config: ClusterConfig | SageMakerConfig) -> dict:
    """The config as plain data, without unset (None) values and empty sections."""
    result: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.metadata["kind"] == "section":
            value = {k: list(v) if isinstance(v, tuple) else v for k, v in config_to_dict(value).items()}
            value = value or None
        elif isinstance(value, dict):
            value = dict(value) or None
        if value is not None:
            result[f.name] = value
    return result


def save_config_file(config: ClusterConfig | SageMakerConfig, path: str | os.PathLike) -> Path:
    """Write ``config`` as YAML (JSON when ``path`` ends with ``.json``), atomically; returns the path."""
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    data = config_to_dict(config)
    if path.suffix == ".json":
        text = json.dumps(data, indent=2, sort_keys=True) + "\n"
    else:
        import yaml

        text = yaml.safe_dump(data, sort_keys=True, default_flow_style=False)
    return atomic_write(path, lambda temporary: temporary.write_text(text, encoding="utf-8"))


@dataclass(frozen=True, slots=True)
class Hardware:
    """The accelerators of this machine: ``kind`` is cuda, xpu, mps or cpu; ``count`` the devices of that kind."""

    kind: str
    count: int

    @property
    def gpus(self) -> int:
        """Number of CUDA/XPU devices (0 on a CPU-only or Apple machine)."""
        return self.count if self.kind in ("cuda", "xpu") else 0


def detect_hardware() -> Hardware:
    """Look at this machine's accelerators (imports torch)."""
    kind = environment.accelerator_type()
    return Hardware(kind, environment.device_count(kind) if kind in ("cuda", "xpu") else 0)


def basic_config(mixed_precision: str = "no", hardware: Hardware | None = None) -> ClusterConfig:
    """A sensible config for this machine: every GPU in one job, or one CPU process without accelerators."""
    hardware = hardware or detect_hardware()
    precision = _as_choice(mixed_precision, MIXED_PRECISION.choices) if mixed_precision else MIXED_PRECISION.default
    multi = {"cuda": DistributedType.MULTI_GPU.value, "xpu": DistributedType.MULTI_XPU.value}
    distributed_type = multi[hardware.kind] if hardware.gpus > 1 else DistributedType.NO.value
    return ClusterConfig(
        distributed_type=distributed_type,
        mixed_precision=precision,
        use_cpu=hardware.kind == "cpu",
        num_processes=max(hardware.gpus, 1),
        gpu_ids="all" if hardware.gpus else None,
    )


def write_basic_config(mixed_precision: str = "no", save_location: str | os.PathLike | None = None):
    """Write a basic launch config for this machine without asking anything.

    Unlike Accelerate, the file is YAML (Accelerate writes JSON text into its ``.yaml`` file).

    Args:
        mixed_precision: ``"no"``, ``"fp16"``, ``"bf16"`` or ``"fp8"``.
        save_location: where to write; default :func:`hasten.environment.default_config_file`.

    Returns:
        The path written, or ``False`` when a file already exists there (it is never overwritten).
    """
    path = Path(save_location or environment.default_config_file()).expanduser()
    if path.exists():
        print(f"A launch config already exists at {path}; it was left unchanged. Delete it first to write a new one.")
        return False
    try:
        config = basic_config(mixed_precision)
    except _Invalid as exc:
        raise ConfigError(f"write_basic_config: mixed_precision={mixed_precision!r} is not valid; {exc}") from None
    return save_config_file(config, path)


# ------------------------------------------------------------------------------ merge


@dataclass(frozen=True, slots=True)
class Source:
    """Where a setting came from: ``kind`` is flag, config file, environment, default or inferred."""

    kind: str
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.kind} {self.detail}".rstrip()


@dataclass(kw_only=True, slots=True)
class ResolvedSettings:
    """The settings in force for one launch, where each came from, and the values that lost to another source."""

    config: ClusterConfig
    sources: dict[str, Source]
    overridden: list[str]

    def source(self, row: Setting) -> Source:
        """Where the launch table's setting ``row`` came from (``settings.source(NUM_PROCESSES)``)."""
        return self.sources[row.key]


@functools.cache
def leaf_fields(cls: type = ClusterConfig, prefix: str = "") -> dict[str, dict]:
    """Dotted path -> field metadata for every setting of ``cls`` (sections expanded); do not modify the result."""
    result: dict[str, dict] = {}
    for name, f in _fields(cls).items():
        if f.metadata["kind"] == "section":
            result.update(leaf_fields(f.metadata["cls"], f"{prefix}{name}."))
        else:
            result[f"{prefix}{name}"] = dict(f.metadata)
    return result


def get_path(config: Any, path: str) -> Any:
    """The value at a dotted path (``"deepspeed_config.zero_stage"``)."""
    for part in path.split("."):
        config = getattr(config, part)
    return config


def _set_path(config: Any, path: str, value: Any) -> None:
    *parents, last = path.split(".")
    for part in parents:
        config = getattr(config, part)
    setattr(config, last, value)


def resolve_settings(
    *,
    flags: dict[str, tuple[Any, str]],
    loaded: LoadedConfig | None,
    env: dict[str, tuple[Any, str]],
    hardware: Callable[[], Hardware],
) -> ResolvedSettings:
    """Merge the sources of launch settings: flags > config file > environment > defaults.

    Args:
        flags: dotted path -> (raw value, flag spelling) for the flags given.
        loaded: the config file read, or None.
        env: dotted path -> (raw value, variable name), e.g. from :func:`environment_settings`.
        hardware: called (once, lazily) when a default depends on the machine.

    Returns:
        The merged config, the source of every value, and a line for each value that another source overrode.

    Raises:
        ConfigError: a flag or environment value is invalid (all problems are listed).
    """
    metas = leaf_fields()
    file_config = loaded.config if loaded is not None else None
    if isinstance(file_config, SageMakerConfig):
        raise ConfigError(f"{loaded.path} is an Amazon SageMaker config; hasten does not launch on SageMaker.")
    layers = [
        ("flag", flags),
        ("config file", {p: (get_path(file_config, p), str(loaded.path)) for p in loaded.present} if loaded else {}),
        ("environment", env),
    ]
    config, sources, overridden, errors = ClusterConfig(), {}, [], []
    for path, meta in metas.items():
        candidates = []
        for kind, values in layers:
            if path in values:
                raw, detail = values[path]
                try:
                    value = raw if kind == "config file" or meta["kind"] == "prefixed" else _convert(raw, meta)
                except _Invalid as exc:
                    errors.append(f"{kind} {detail}: {path}={raw!r} is not valid; {exc}")
                    continue
                candidates.append((value, Source(kind, detail)))
        if not candidates:
            sources[path] = Source("default")
            continue
        value, source = candidates[0]
        _set_path(config, path, value)
        sources[path] = source
        overridden += [
            f"{path}: {value!r} from {source} overrides {other!r} from {where}"
            for other, where in candidates[1:]
            if other != value
        ]
    if errors:
        raise ConfigError("Invalid launch settings:\n" + "\n".join(f"  - {line}" for line in errors))
    _infer(config, sources, hardware)
    return ResolvedSettings(config=config, sources=sources, overridden=overridden)


def _infer(config: ClusterConfig, sources: dict[str, Source], hardware: Callable[[], Hardware]) -> None:
    """Fill the settings whose default depends on the machine and on the other settings."""
    if config.num_processes is None:
        gpus = 0 if config.use_cpu else hardware().gpus
        config.num_processes = max(gpus, 1) * max(config.num_machines, 1)
        sources[NUM_PROCESSES.key] = Source("inferred", f"({gpus} GPU(s) found)" if gpus else "(no GPU found)")
    multi = config.num_processes > 1 or config.num_machines > 1
    kind = config.distributed_type
    if (kind == DistributedType.NO.value and multi) or (kind in _GPU_TYPES and config.use_cpu):
        if not multi:
            new = DistributedType.NO.value
        elif config.use_cpu or not hardware().gpus:
            new = DistributedType.MULTI_CPU.value
        else:
            new = DistributedType.MULTI_XPU.value if hardware().kind == "xpu" else DistributedType.MULTI_GPU.value
        if new != kind:
            config.distributed_type = new
            sources[DISTRIBUTED_TYPE.key] = Source(
                "inferred", f"(num_processes={config.num_processes}, use_cpu={config.use_cpu})"
            )


# ------------------------------------------------------------------------------ environment


# dotted config path -> variable (without prefix) that carries it to the processes
_ENV_NAMES: dict[str, str] = {path: name for table in (LAUNCH, *SECTIONS) for path, name in table.env_paths().items()}


def environment_settings() -> dict[str, tuple[Any, str]]:
    """Launch settings given by ``HASTEN_*`` (or ``ACCELERATE_*``) variables: dotted path -> (value, variable).

    An engine's switch variable (``HASTEN_USE_DEEPSPEED``) gives ``distributed_type``.
    """
    found: dict[str, tuple[Any, str]] = {}
    for path, name in _ENV_NAMES.items():
        if environment.setting_source(name):
            found[path] = (environment.get_str(name), environment.setting_source(name))
    for engine in environment.ENGINES:
        if engine.switch and environment.get_flag(engine.switch):
            found[DISTRIBUTED_TYPE.key] = (engine.distributed_type, environment.setting_source(engine.switch))
    return found


def _env_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _exported(path: str, kind: str) -> bool:
    """Whether ``hasten launch`` exports the setting at ``path`` to the processes of a ``kind`` job."""
    section, _, key = path.rpartition(".")
    table = next((t for t in SECTIONS if t.name == section), None)
    if table is None or table.only_with is None or kind == table.only_with:
        return True
    return table.by_key(key).always_export


def launch_environment(settings: ResolvedSettings) -> dict[str, str]:
    """The ``HASTEN_*`` variables that carry ``settings`` to the processes ``hasten launch`` starts: the settings'
    variables, every engine's switch (true for the one that runs) and the running engine's own variables."""
    config = settings.config
    kind = config.distributed_type
    env = {prefixed("LAUNCHED"): "1"}
    for path, name in _ENV_NAMES.items():
        value = get_path(config, path)
        if value is not None and _exported(path, kind):
            env[prefixed(name)] = _env_text(value)
    override = config.fp8_config.override_linear_precision
    if override is not None:
        for part, flag in zip(("FPROP", "DGRAD", "WGRAD"), override):
            env[prefixed(f"FP8_OVERRIDE_{part}")] = _env_text(flag)
    for engine in environment.ENGINES:
        if engine.switch:
            env[prefixed(engine.switch)] = _env_text(kind == engine.distributed_type)
        if kind in engine.distributed_types and engine.launch_variables is not None:
            env |= engine.launch_variables(settings)
    env[prefixed("LAUNCH_SOURCES")] = json.dumps(
        {p: str(s) for p, s in settings.sources.items() if s.kind != "default"}, sort_keys=True
    )
    return env
