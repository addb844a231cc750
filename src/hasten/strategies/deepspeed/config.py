"""DeepSpeed JSON configs: loading, key validation, ``"auto"`` resolution and conflict checks.

:func:`fill` is the one function that replaces ``"auto"`` values: the plugin's explicit fields, the
mixed precision, the values ``prepare`` reads from the script (:func:`auto_values`), Accelerate's
``deepspeed_config_process`` (:func:`fill_from_script`) and the ``zero.Init`` copy all go through it.

DeepSpeed reads its config leniently: a misspelled key silently falls back to the default. hasten
checks every key against :data:`.schema.SCHEMA` (completed at run time with the fields of the installed
DeepSpeed's own config models) and names the closest valid key. ``"auto"`` values are filled from the
training script: the prepared dataloader, the accumulation steps, the mixed precision, the optimizer,
the scheduler and the model's hidden size (see :func:`auto_values`). A value set both in the file and
by the script must agree; a disagreement is an error naming both values and where each came from.

Nothing here imports ``deepspeed`` at module level.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import ConfigError, NotSupportedError
from ...settings.deepspeed import AUTO, OFFLOAD_DEVICES
from .schema import unknown_keys

# ------------------------------------------------------------------------------------- loading


def load_config(source) -> tuple[dict, str]:
    """Read a DeepSpeed config: a dict (copied), or the path of a JSON file.

    Returns:
        The config and a name for messages (``"the DeepSpeed config 'ds.json'"``).
    """
    if isinstance(source, dict):
        return copy.deepcopy(source), "the DeepSpeed config dict"
    if not isinstance(source, (str, Path)):
        raise ConfigError(f"hf_ds_config must be a dict or the path of a JSON file, got {type(source).__name__}.")
    path = Path(source).expanduser()
    name = f"the DeepSpeed config {str(path)!r}"
    if not path.is_file():
        raise ConfigError(
            f"{name} does not exist. Pass the path of a DeepSpeed JSON file (--deepspeed_config_file) or a dict."
        )
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ConfigError(
            f"{name} is not valid JSON: {error.msg} at line {error.lineno}, column {error.colno}."
        ) from None
    if not isinstance(config, dict):
        raise ConfigError(f"{name} must hold a JSON object ({{...}}), not a {type(config).__name__}.")
    return config, name


# ----------------------------------------------------------------------------------- validation


def validate_config(config: dict, name: str, schema: dict | None = None) -> None:
    """Check every key of ``config`` and the values hasten relies on; raise :class:`ConfigError` on the first problem.

    Unknown keys are all listed in one message, each with a did-you-mean suggestion.
    """
    unknown = unknown_keys(config, schema)
    if unknown:
        lines = [
            f"  - {path}" + (f" (did you mean {_sibling(path, hint)!r}?)" if hint else "") for path, hint in unknown
        ]
        raise ConfigError(
            f"{name} has keys DeepSpeed does not know (DeepSpeed would silently ignore them and use its defaults):\n"
            + "\n".join(lines)
            + "\nFix the spelling, or remove the keys. The valid keys are listed at https://www.deepspeed.ai/docs/config-json/."
        )
    _validate_values(config, name)


def _sibling(path: str, key: str) -> str:
    parent = path.rpartition(".")[0]
    return f"{parent}.{key}" if parent else key


def _validate_values(config: dict, name: str) -> None:
    stage = get_value(config, "zero_optimization.stage")
    if stage is not None and stage != AUTO and stage not in (0, 1, 2, 3):
        raise ConfigError(f"zero_optimization.stage={stage!r} in {name} is not a ZeRO stage; use 0, 1, 2 or 3.")
    for section in ("offload_optimizer", "offload_param"):
        device = get_value(config, f"zero_optimization.{section}.device")
        if device is None or device == AUTO:
            continue
        if device not in OFFLOAD_DEVICES:
            raise ConfigError(
                f"zero_optimization.{section}.device={device!r} in {name} is not one of {list(OFFLOAD_DEVICES)}."
            )
        if device == "nvme" and get_value(config, f"zero_optimization.{section}.nvme_path") in (None, "none", AUTO):
            raise ConfigError(
                f"zero_optimization.{section}.device is 'nvme' in {name} but no nvme_path is set; add the folder on "
                f"the NVMe drive as zero_optimization.{section}.nvme_path."
            )
    if get_value(config, "zero_optimization.offload_param.device") not in (None, "none", AUTO) and stage not in (
        3,
        AUTO,
    ):
        raise ConfigError(
            f"{name} offloads parameters (zero_optimization.offload_param) with ZeRO stage {stage}; parameter offload "
            "needs stage 3."
        )
    if get_value(config, "fp16.enabled") is True and get_value(config, "bf16.enabled") is True:
        raise ConfigError(f'{name} enables both fp16 and bf16; enable one of them (or set both to "auto").')


# ------------------------------------------------------------------------------------ key paths

_MISSING = object()


def get_value(config: dict, path: str, default=None):
    """The value at a dotted key path (``"zero_optimization.stage"``), or ``default``."""
    node = config
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def _set_value(config: dict, path: str, value) -> None:
    """Set the value at a dotted key path, creating the sections on the way."""
    *parents, last = path.split(".")
    node = config
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value


def delete_value(config: dict, path: str) -> None:
    """Remove the key at a dotted path (nothing happens when it is absent)."""
    *parents, last = path.split(".")
    node = get_value(config, ".".join(parents)) if parents else config
    if isinstance(node, dict):
        node.pop(last, None)


def leaf_paths(config: dict, prefix: str = "") -> list[str]:
    """The dotted key paths of every value that is not a section."""
    paths = []
    for key, value in config.items():
        if isinstance(value, dict):
            paths.extend(leaf_paths(value, f"{prefix}{key}."))
        else:
            paths.append(f"{prefix}{key}")
    return paths


def auto_paths(config: dict) -> list[str]:
    """The key paths whose value is ``"auto"``."""
    return [path for path in leaf_paths(config) if get_value(config, path) == AUTO]


# ------------------------------------------------------------------------------ filling values


@dataclass(frozen=True)
class Setting:
    """A value the script gives for a config key, and where it came from (for messages).

    A ``default`` setting only fills ``"auto"``: a value written in the file wins without a note.
    """

    value: Any
    source: str
    default: bool = False


def values_equal(a, b) -> bool:
    """Whether two config values are the same (lists and tuples alike, 1e9 == 1000000000, True != 1)."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(values_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or (isinstance(a, bool) and isinstance(b, bool) and a == b)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0)
    return a == b


def _plain(value):
    return list(value) if isinstance(value, tuple) else value


def fill(
    config: dict,
    settings: dict[str, Setting],
    name: str,
    must_match: tuple[str, ...] = (),
    add_missing: tuple[str, ...] = (),
) -> list[str]:
    """Fill ``"auto"`` values of ``config`` from ``settings`` (dotted path -> :class:`Setting`): the only place that
    does.

    A path in ``must_match`` whose value is set in the file and differs from the script's is a
    conflict: all conflicts are reported together in one :class:`ConfigError` naming both values.
    Paths in ``add_missing`` are also set when the file does not mention them (or sets them to null).

    Returns:
        Notes on values the file sets that differ from the script's but win (paths not in ``must_match``).
    """
    conflicts, notes = [], []
    for path, setting in settings.items():
        current = get_value(config, path, _MISSING)
        if current is _MISSING or (current is None and path in add_missing):
            if path in add_missing:
                _set_value(config, path, _plain(setting.value))
        elif current == AUTO:
            _set_value(config, path, _plain(setting.value))
        elif not setting.default and not values_equal(current, setting.value):
            line = f"{path}: {current!r} in {name}, but {setting.value!r} from {setting.source}"
            (conflicts if path in must_match else notes).append(line)
    if conflicts:
        raise ConfigError(
            "The DeepSpeed config and the training script disagree:\n"
            + "\n".join(f"  - {line}" for line in conflicts)
            + '\nMake them agree: change one of the two, or set the value to "auto" in the DeepSpeed config so that it '
            "follows the script."
        )
    return notes


def fill_from_script(
    config: dict, name: str, values: dict, must_match: bool = True, mismatches: list | None = None
) -> None:
    """Fill the ``"auto"`` keys among ``values`` (dotted path -> the script's value) with :func:`fill`.

    Accelerate's ``deepspeed_config_process``: keys the file leaves out or sets to null are skipped. With
    ``must_match``, a key the file sets to another value is a mismatch: appended to ``mismatches`` when a
    list is given, otherwise all of them raised in one :class:`ConfigError`.
    """
    settings = {
        path: Setting(value, "the script") for path, value in values.items() if get_value(config, path) is not None
    }
    found = fill(config, settings, name)
    if not must_match:
        return
    if mismatches is not None:
        mismatches.extend(found)
    elif found:
        raise ConfigError(
            "The DeepSpeed config and the training script disagree:\n"
            + "\n".join(f"  - {m}" for m in found)
            + '\nMake them agree, or set the values to "auto".'
        )


def _precision_settings(mixed_precision: str) -> dict[str, Setting]:
    source = f"mixed_precision={mixed_precision!r}"
    return {f"{kind}.enabled": Setting(mixed_precision == kind, source, default=True) for kind in ("fp16", "bf16")}


def apply_mixed_precision(config: dict, mixed_precision: str, name: str) -> None:
    """Make ``config`` train in ``mixed_precision``: enable its section, fill ``fp16``/``bf16`` ``"auto"``; a
    contradiction is an error."""
    if mixed_precision == "fp8":
        raise NotSupportedError("mixed_precision='fp8' with DeepSpeed is not supported by hasten; use 'bf16'.")
    for kind, other in (("fp16", "bf16"), ("bf16", "fp16")):
        if mixed_precision == kind and get_value(config, f"{other}.enabled") is True:
            raise ConfigError(
                f"mixed_precision={kind!r} but {name} enables {other} ({other}.enabled: true). "
                f'Make them agree: set {other}.enabled to false or "auto", or use mixed_precision={other!r}.'
            )
        if mixed_precision == kind and kind not in config:
            config[kind] = {"enabled": True, **({"auto_cast": True} if kind == "fp16" else {})}
    fill(config, _precision_settings(mixed_precision), name)


def mixed_precision_of(config: dict) -> str:
    """The precision ``config`` trains in: ``"fp16"``, ``"bf16"`` or ``"no"``."""
    for kind in ("fp16", "bf16"):
        if get_value(config, f"{kind}.enabled") is True:
            return kind
    return "bf16" if get_value(config, "bfloat16.enabled") is True else "no"


# ------------------------------------------------------------------------------- the auto table


@dataclass
class ScriptValues:
    """What the training script says about the values DeepSpeed's config can leave as ``"auto"``.

    Each field is a :class:`Setting` or None when the script does not say.
    """

    micro_batch_size: Setting | None = None
    num_processes: int = 1
    gradient_accumulation_steps: Setting | None = None
    gradient_clipping: Setting | None = None
    mixed_precision: str = "no"
    hidden_size: Setting | None = None
    optimizer: dict[str, Setting] | None = None
    scheduler: dict[str, Setting] | None = None


def auto_values(script: ScriptValues) -> dict[str, Setting]:
    """The value of every ``"auto"`` key the script determines (Transformers' DeepSpeed guide's table).

    - ``train_micro_batch_size_per_gpu``: the prepared dataloader's batch size per process;
      ``train_batch_size`` = processes x micro batch x accumulation steps;
    - ``gradient_accumulation_steps``, ``gradient_clipping`` (1.0 when the script does not say);
    - ``fp16.enabled`` / ``bf16.enabled`` from the mixed precision;
    - ``zero_optimization.reduce_bucket_size`` = hidden_size², ``stage3_prefetch_bucket_size`` =
      0.9 x hidden_size², ``stage3_param_persistence_threshold`` = 10 x hidden_size;
    - ``optimizer.params.*`` and ``scheduler.params.*`` from ``DummyOptim`` / ``DummyScheduler``.
    """
    values: dict[str, Setting] = {}
    gas = script.gradient_accumulation_steps
    if gas is not None:
        values["gradient_accumulation_steps"] = gas
    micro = script.micro_batch_size
    if micro is not None:
        values["train_micro_batch_size_per_gpu"] = micro
        if gas is not None:
            total = micro.value * script.num_processes * gas.value
            values["train_batch_size"] = Setting(
                total, f"{script.num_processes} processes x micro batch {micro.value} x {gas.value} accumulation steps"
            )
    values["gradient_clipping"] = script.gradient_clipping or Setting(
        1.0, "the default gradient clipping", default=True
    )
    values.update(_precision_settings(script.mixed_precision))
    if script.hidden_size is not None:
        hidden, source = script.hidden_size.value, script.hidden_size.source
        values["zero_optimization.reduce_bucket_size"] = Setting(hidden * hidden, f"{source} squared", default=True)
        values["zero_optimization.stage3_prefetch_bucket_size"] = Setting(
            int(0.9 * hidden * hidden), f"0.9 x ({source}) squared", default=True
        )
        values["zero_optimization.stage3_param_persistence_threshold"] = Setting(
            10 * hidden, f"10 x {source}", default=True
        )
    for section, settings in (("optimizer", script.optimizer), ("scheduler", script.scheduler)):
        for key, setting in (settings or {}).items():
            values[f"{section}.params.{key}"] = setting
    return values


_AUTO_HINTS = {
    "train_micro_batch_size_per_gpu": (
        "prepare a DataLoader in the same prepare() call as the model, or write the per-process batch size in the "
        "config"
    ),
    "train_batch_size": "prepare a DataLoader with the model, or write the global batch size in the config",
    "zero_optimization.reduce_bucket_size": (
        "the model has no config.hidden_size; write a number (DeepSpeed's default is 5e8)"
    ),
    "zero_optimization.stage3_prefetch_bucket_size": (
        "the model has no config.hidden_size; write a number (DeepSpeed's default is 5e7)"
    ),
    "zero_optimization.stage3_param_persistence_threshold": (
        "the model has no config.hidden_size; write a number (DeepSpeed's default is 1e5)"
    ),
    "scheduler.params.total_num_steps": (
        "pass DummyScheduler(optimizer, total_num_steps=...) or write the number in the config"
    ),
}
_DEFAULT_HINT = 'replace "auto" with a value'


def check_resolved(config: dict, name: str) -> None:
    """Raise :class:`ConfigError` naming every key still ``"auto"`` and how to give it a value."""
    left = auto_paths(config)
    if left:
        lines = [f"  - {path}: {_AUTO_HINTS.get(path, _DEFAULT_HINT)}" for path in left]
        raise ConfigError(f'{name} has "auto" values that the training script does not determine:\n' + "\n".join(lines))


def config_for_zero_init(config: dict, mixed_precision: str) -> dict:
    """A copy of ``config`` that ``deepspeed.zero.Init`` accepts before ``prepare`` resolved the batch sizes.

    ``zero.Init`` only needs the ZeRO and precision sections; batch-size keys that are still
    ``"auto"`` get placeholder values and other ``"auto"`` keys fall back to DeepSpeed's defaults.
    """
    result = copy.deepcopy(config)
    placeholders = {
        path: Setting(1, "a placeholder until prepare()", default=True)
        for path in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    }
    fill(
        result,
        {**_precision_settings(mixed_precision), **placeholders},
        "the config for deepspeed.zero.Init",
        add_missing=tuple(placeholders),
    )
    for path in auto_paths(result):
        delete_value(result, path)
    return result


def describe(config: dict) -> str:
    """The config as indented JSON, for the log."""
    return json.dumps(config, indent=2, sort_keys=True, default=str)
