"""How large a model is, without building it in memory: parameter counts and the per-dtype footprint.

The per-dtype table of ``hasten estimate-memory`` gives the weights' size, the largest layer (what must fit on one
device when a model is dispatched) and the peak of training with Adam, computed as Accelerate's ``estimate-memory``
does (4x the fp32 size; 4x the half-precision size in fp16/bf16). The engines add their own tables from the counts
(``Engine.memory_table``: DeepSpeed's ZeRO table).

A model is described by its parameter counts, taken from a module (built on the meta device, so nothing is
allocated), from a local Transformers ``config.json``, or given directly.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import ConfigError, MissingDependencyError, closest, did_you_mean

#: Known models: name -> (parameters, parameters of the largest layer), as DeepSpeed counts them for
#: ``AutoModel`` (no language-model head unless tied). T0_3B reproduces the Transformers DeepSpeed guide.
KNOWN_MODELS: dict[str, tuple[int, int]] = {
    "bigscience/T0_3B": (2_783_959_040, 65_798_144),
    "bert-base-uncased": (109_482_240, 23_440_896),
    "bert-base-cased": (108_310_272, 22_268_928),
    "gpt2": (124_439_808, 38_597_376),
}

DTYPE_BYTES = {"float32": 4.0, "float16": 2.0, "bfloat16": 2.0, "int8": 1.0, "int4": 0.5}


@dataclass(frozen=True)
class ModelSize:
    """Parameter counts of a model.

    Attributes:
        name: how the model was named (for the report).
        total_params: all parameters (shared ones counted once).
        largest_layer_params: parameters of the module holding the most parameters of its own (DeepSpeed's "largest
            layer").
        largest_group_params: parameters of the largest block kept whole on one device (a layer, or a
            transformer block listed in ``_no_split_modules``); defaults to ``largest_layer_params``.
    """

    name: str
    total_params: int
    largest_layer_params: int
    largest_group_params: int | None = None

    @property
    def largest_group(self) -> int:
        """:attr:`largest_group_params`, falling back to :attr:`largest_layer_params`."""
        return self.largest_group_params if self.largest_group_params is not None else self.largest_layer_params


@dataclass(frozen=True)
class DtypeRow:
    """Sizes in bytes for one dtype; ``training_bytes`` is None where training in it is not possible."""

    dtype: str
    largest_group_bytes: float
    total_bytes: float
    training_bytes: float | None


def dtype_rows(size: ModelSize, dtypes: list[str]) -> list[DtypeRow]:
    """Weights, largest block and Adam training peak for each dtype (Accelerate's ``estimate-memory`` table)."""
    rows = []
    for dtype in dtypes:
        if dtype not in DTYPE_BYTES:
            raise ConfigError(
                f"Unknown dtype {dtype!r}; choose from {list(DTYPE_BYTES)}.{did_you_mean(dtype, DTYPE_BYTES)}"
            )
        per = DTYPE_BYTES[dtype]
        total = size.total_params * per
        # Adam: weights, gradients and two states; int8/int4 weights are not trained.
        training = 4 * total if dtype in ("float32", "float16", "bfloat16") else None
        rows.append(DtypeRow(dtype, size.largest_group * per, total, training))
    return rows


# ------------------------------------------------------------------------------ model sizes


def count_parameters(model: torch.nn.Module) -> ModelSize:
    """Count the parameters of a module (which may live on the meta device)."""
    seen: set[int] = set()
    total = 0
    for parameter in model.parameters():
        if id(parameter) not in seen:
            seen.add(id(parameter))
            total += parameter.numel()
    largest_layer = max(
        (sum(p.numel() for p in module.parameters(recurse=False)) for module in model.modules()), default=0
    )
    keep_whole = set(getattr(model, "_no_split_modules", None) or [])
    groups = [
        sum(p.numel() for p in module.parameters())
        for module in model.modules()
        if type(module).__name__ in keep_whole or not any(True for _ in module.children())
    ]
    return ModelSize(type(model).__name__, total, largest_layer, max(groups + [largest_layer]))


def model_size(name: str, trust_remote_code: bool = False) -> ModelSize:
    """Describe the model called ``name``: a known model, a ``module:factory`` path, or a local ``config.json``.

    Nothing is downloaded; modules are built on the meta device (no memory is allocated).
    """
    for known, (total, largest) in KNOWN_MODELS.items():
        if name.lower() in (known.lower(), known.rsplit("/", 1)[-1].lower()):
            return ModelSize(known, total, largest)
    path = Path(name).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        path = path / "config.json"
    if path.is_file():
        size = _from_transformers_config(path, trust_remote_code)
    elif ":" in name and not path.exists():
        size = _from_factory(name)
    else:
        known = ", ".join(KNOWN_MODELS)
        raise ConfigError(
            f"Unknown model {name!r}: hasten estimate-memory does not download models.{_suggest(name)} Pass a local "
            f"config.json (or the folder holding it), a 'module:factory' that builds the model, --num_params (with "
            f"--largest_layer), or one of the known models: {known}."
        )
    return ModelSize(name, size.total_params, size.largest_layer_params, size.largest_group_params)


def _suggest(name: str) -> str:
    names = {short.lower(): known for known in KNOWN_MODELS for short in (known, known.rsplit("/", 1)[-1])}
    match = closest(name.lower().replace("-", "_"), names)
    return f" Did you mean {names[match]!r}?" if match else ""


def _from_factory(spec: str) -> ModelSize:
    module_name, _, attribute = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise ConfigError(
            f"Cannot load {spec!r}: {error}. Give 'package.module:function' where function() builds the model."
        ) from None
    with torch.device("meta"):
        model = factory()
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"{spec} returned {type(model).__name__}, not a torch.nn.Module.")
    return count_parameters(model)


def _from_transformers_config(path: Path, trust_remote_code: bool) -> ModelSize:
    try:
        json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ConfigError(f"{path} is not a readable JSON config: {error}") from None
    try:
        import transformers
    except ImportError:
        raise MissingDependencyError(
            f"Reading {path} needs the transformers package to build the model (on the meta device). Install it with: "
            "pip install transformers, or pass --num_params/--largest_layer."
        ) from None
    config = transformers.AutoConfig.from_pretrained(str(path.parent), trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = transformers.AutoModel.from_config(config, trust_remote_code=trust_remote_code)
    return count_parameters(model)
