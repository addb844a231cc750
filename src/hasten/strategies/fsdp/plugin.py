"""``FullyShardedDataParallelPlugin``: the settings of hasten's FSDP2 strategy (``torch.distributed.fsdp.fully_shard``).

Fields keep Accelerate's names. Each field comes from its argument, else from the ``FSDP_*`` setting
(``HASTEN_FSDP_*``, ``ACCELERATE_FSDP_*`` or the bare ``FSDP_*`` variable, as written by ``hasten launch``
from the flags and the config file's ``fsdp_config`` block), else from a default: the rows of
:mod:`hasten.settings.fsdp` say which variable fills which field.

hasten runs FSDP2 only. FSDP1 settings are translated where FSDP2 has the same behaviour
(``sharding_strategy`` becomes ``reshard_after_forward`` plus a device mesh; ``use_orig_params=True``,
``limit_all_gathers=True`` and ``backward_prefetch="BACKWARD_PRE"`` are what FSDP2 always does); an
FSDP1 setting FSDP2 cannot honour is a :class:`~hasten.errors.ConfigError` that names it. See
``docs/fsdp.md`` for the table.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from ... import environment
from ...errors import ConfigError, did_you_mean
from ...settings.fsdp import FSDP
from ...settings.fsdp import FSDP_AUTO_WRAP_POLICIES as AUTO_WRAP_POLICIES
from ...settings.fsdp import FSDP_BACKWARD_PREFETCH as _PREFETCH
from ...settings.fsdp import FSDP_RESHARD_AFTER_FORWARD as _RESHARD
from ...settings.fsdp import FSDP_SHARDING_STRATEGIES as SHARDING_STRATEGIES
from ...settings.fsdp import FSDP_STATE_DICT_TYPES as STATE_DICT_TYPES

DEFAULT_MIN_NUM_PARAMS = 100_000_000

_DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
}


def _name(value, choices: tuple[str, ...], setting: str) -> str:
    """An enum-like value (string, number from 1, or an FSDP1 enum member) as one of ``choices``."""
    text = getattr(value, "name", value)
    text = str(text).strip().upper()
    if text.isdigit() and 1 <= int(text) <= len(choices):
        return choices[int(text) - 1]
    if text not in choices:
        raise ConfigError(
            f"FullyShardedDataParallelPlugin: {setting}={value!r} is not one of "
            f"{list(choices)}.{did_you_mean(text, choices)}"
        )
    return text


def _bool_or_name(text: str, setting: str) -> bool | str:
    try:
        return bool(environment.str_to_bool(text))
    except ConfigError:
        return _name(text, SHARDING_STRATEGIES, setting)


def _dtype(value, setting: str) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    text = str(value).lower().removeprefix("torch.")
    if text not in _DTYPES:
        raise ConfigError(
            f"FullyShardedDataParallelPlugin: mixed_precision_policy {setting}={value!r} is not a dtype; use one of "
            f"{sorted(_DTYPES)} or a torch.dtype."
        )
    return _DTYPES[text]


def _fsdp1_only(setting: str, value, why: str) -> ConfigError:
    return ConfigError(
        f"FullyShardedDataParallelPlugin: {setting}={value!r} is an FSDP1 setting that FSDP2 (the only FSDP hasten "
        f"runs) cannot honour: {why}"
    )


@dataclass
class FullyShardedDataParallelPlugin:
    """Settings of FSDP2 training (``torch.distributed.fsdp.fully_shard``).

    Args:
        fsdp_version: 2 (the default). 1 is refused: hasten runs FSDP2 only.
        sharding_strategy: FSDP1 name, translated: ``FULL_SHARD`` (reshard after forward; ZeRO-3),
            ``SHARD_GRAD_OP`` (keep parameters gathered between forward and backward; ZeRO-2),
            ``HYBRID_SHARD`` / ``HYBRID_SHARD_ZERO2`` (shard within a machine, replicate across machines),
            ``NO_SHARD`` (replicate on every process, like DDP).
        reshard_after_forward: FSDP2's switch (True = FULL_SHARD, False = SHARD_GRAD_OP, or an int: the
            size of the smaller group to reshard to). A sharding strategy name is accepted here too.
        backward_prefetch: only ``"BACKWARD_PRE"`` (what FSDP2 always does) or None.
        mixed_precision_policy: a ``torch.distributed.fsdp.MixedPrecisionPolicy``, a dict of its fields
            (dtypes as ``torch.dtype`` or names like ``"bf16"``), or an FSDP1 ``MixedPrecision`` without
            ``buffer_dtype``. Default with ``mixed_precision="bf16"``/``"fp16"``: parameters gathered in that
            dtype, gradients reduced in fp32 (see :meth:`set_mixed_precision`).
        auto_wrap_policy: which submodules get their own ``fully_shard`` (their own all-gather):
            ``"TRANSFORMER_BASED_WRAP"`` (classes named in ``transformer_cls_names_to_wrap``, else the model's
            ``_no_split_modules``), ``"SIZE_BASED_WRAP"`` (modules with at least ``min_num_params`` parameters
            not already wrapped), ``"NO_WRAP"``, or a callable ``policy(module) -> bool``. An FSDP1 policy
            made with ``functools.partial`` of ``transformer_auto_wrap_policy``, ``size_based_auto_wrap_policy``
            or ``lambda_auto_wrap_policy`` is read too.
        cpu_offload: keep sharded parameters, gradients and the optimizer step on the CPU (True, or a
            ``CPUOffloadPolicy``; an FSDP1 ``CPUOffload`` is read).
        ignored_modules: modules left unsharded (their parameters are neither sharded nor reduced), as
            modules or as a regular expression matched (``re.fullmatch``) against module names.
        state_dict_type: ``"SHARDED_STATE_DICT"`` (default; each process writes its shards with
            ``torch.distributed.checkpoint``) or ``"FULL_STATE_DICT"`` (gathered on process 0).
            ``LOCAL_STATE_DICT`` is FSDP1 only.
        state_dict_config, optim_state_dict_config: FSDP1 objects, accepted for compatibility; FSDP2 full
            state dicts are always gathered on process 0 and on the CPU.
        limit_all_gathers: True (FSDP2 always bounds the all-gathers in flight); False is refused.
        use_orig_params: True or None (FSDP2 always trains the original parameters); False is refused.
        param_init_fn: refused (FSDP1); use ``cpu_ram_efficient_loading`` with a model built on the meta
            device on processes other than 0.
        sync_module_states: broadcast process 0's weights into every shard at setup (default: the value of
            ``cpu_ram_efficient_loading``).
        forward_prefetch: gather the next wrapped module's parameters while the current one runs forward.
        activation_checkpointing: recompute the activations of each wrapped module (the auto wrap policy's
            modules) in backward instead of storing them.
        activation_checkpointing_offload: refused (not supported).
        cpu_ram_efficient_loading: process 0 holds the weights, other processes may build the model on the
            meta device; the weights are broadcast into the shards at setup.
        transformer_cls_names_to_wrap: class names for ``TRANSFORMER_BASED_WRAP`` (a list, or a comma-separated string).
        min_num_params: threshold of ``SIZE_BASED_WRAP`` (default 100,000,000).
    """

    fsdp_version: int | None = None
    sharding_strategy: Any = None
    reshard_after_forward: bool | int | str | None = None
    backward_prefetch: Any = None
    mixed_precision_policy: Any = None
    auto_wrap_policy: str | Callable | None = None
    cpu_offload: Any = None
    ignored_modules: Iterable[torch.nn.Module] | str | None = None
    state_dict_type: Any = None
    state_dict_config: Any = None
    optim_state_dict_config: Any = None
    limit_all_gathers: bool = True
    use_orig_params: bool | None = None
    param_init_fn: Callable | None = None
    sync_module_states: bool | None = None
    forward_prefetch: bool | None = None
    activation_checkpointing: bool | None = None
    activation_checkpointing_offload: bool | None = None
    cpu_ram_efficient_loading: bool | None = None
    transformer_cls_names_to_wrap: list[str] | str | None = None
    min_num_params: int | None = None

    def __post_init__(self):
        from_env = environment.fill_unset(self, FSDP.rows)
        self._resolve_version()
        self._resolve_sharding(from_env)
        self._resolve_fsdp1_settings()
        self._resolve_wrapping()
        self.validate_cpu_offload()
        self.validate_mixed_precision_policy()
        self.set_state_dict_type(self.state_dict_type)
        if isinstance(self.ignored_modules, str):
            self.ignored_modules = self.ignored_modules or None
        self._resolve_loading()

    # ------------------------------------------------------------------------------- resolution

    def _resolve_version(self) -> None:
        if str(self.fsdp_version) != "2":
            raise ConfigError(
                f"FullyShardedDataParallelPlugin: fsdp_version={self.fsdp_version!r}; hasten runs FSDP2 "
                "(torch.distributed.fsdp.fully_shard) only. Set fsdp_version: 2 (launch flag --fsdp_version 2); FSDP1 "
                "settings are translated or refused one by one (see docs/fsdp.md)."
            )
        self.fsdp_version = 2

    def _resolve_sharding(self, from_env: set[str]) -> None:
        strategy = (
            _name(self.sharding_strategy, SHARDING_STRATEGIES, "sharding_strategy")
            if self.sharding_strategy is not None
            else None
        )
        reshard = self.reshard_after_forward
        if "reshard_after_forward" in from_env:
            reshard = _bool_or_name(reshard, "FSDP_RESHARD_AFTER_FORWARD")
        if isinstance(reshard, str):
            named = _name(reshard, SHARDING_STRATEGIES, "reshard_after_forward")
            if strategy is not None and strategy != named:
                raise ConfigError(
                    f"FullyShardedDataParallelPlugin: sharding_strategy={strategy!r} and "
                    f"reshard_after_forward={reshard!r} disagree; set one of them."
                )
            strategy, reshard = named, None
        if strategy is not None and reshard is not None and _RESHARD[strategy] != reshard:
            raise ConfigError(
                f"FullyShardedDataParallelPlugin: sharding_strategy={strategy!r} means "
                f"reshard_after_forward={_RESHARD[strategy]}, but reshard_after_forward={reshard!r} was given; set "
                "only one of them."
            )
        if isinstance(reshard, bool) or reshard is None:
            self.reshard_after_forward = (
                _RESHARD[strategy] if reshard is None and strategy else (True if reshard is None else reshard)
            )
        elif isinstance(reshard, int) and reshard > 0:
            self.reshard_after_forward = reshard
        else:
            raise ConfigError(
                f"FullyShardedDataParallelPlugin: reshard_after_forward={reshard!r}; give True, False, a positive int "
                "or a sharding strategy name."
            )
        self.sharding_strategy = strategy or (
            "FULL_SHARD" if self.reshard_after_forward is not False else "SHARD_GRAD_OP"
        )

    def _resolve_fsdp1_settings(self) -> None:
        prefetch = self.backward_prefetch
        if prefetch is not None:
            prefetch = _name(prefetch, _PREFETCH, "backward_prefetch")
            if prefetch != "BACKWARD_PRE":
                raise _fsdp1_only(
                    "backward_prefetch",
                    prefetch,
                    "FSDP2 always gathers the next module's parameters before its backward (BACKWARD_PRE). Remove the "
                    "setting or set it to BACKWARD_PRE.",
                )
        self.backward_prefetch = prefetch
        if self.use_orig_params is False:
            raise _fsdp1_only(
                "use_orig_params",
                False,
                "FSDP2 has no flat parameters and always trains the original ones. Remove the setting or set it to "
                "True.",
            )
        if not self.limit_all_gathers:
            raise _fsdp1_only(
                "limit_all_gathers",
                self.limit_all_gathers,
                "FSDP2 always bounds the all-gathers in flight. Remove the setting.",
            )
        if self.param_init_fn is not None:
            raise _fsdp1_only(
                "param_init_fn",
                self.param_init_fn,
                "build the model on the meta device on processes other than 0 and set cpu_ram_efficient_loading=True "
                "(process 0's weights are broadcast into the shards), or initialise the weights before prepare().",
            )
        if self.activation_checkpointing_offload:
            raise ConfigError(
                "FullyShardedDataParallelPlugin: activation_checkpointing_offload=True is not supported by hasten. "
                "Use activation_checkpointing=True (recomputation without offload), or cpu_offload=True to offload "
                "parameters."
            )

    def _resolve_wrapping(self) -> None:
        names = self.transformer_cls_names_to_wrap
        if isinstance(names, str):
            names = [n.strip() for n in names.split(",") if n.strip()]
        self.transformer_cls_names_to_wrap = list(names) if names else None
        policy = self.auto_wrap_policy
        if isinstance(policy, functools.partial):
            policy = self._from_fsdp1_policy(policy)
        if policy is None:
            policy = (
                "TRANSFORMER_BASED_WRAP"
                if self.transformer_cls_names_to_wrap
                else ("SIZE_BASED_WRAP" if self.min_num_params else "NO_WRAP")
            )
        if callable(policy):
            _check_one_argument(policy)
        else:
            policy = _name(policy, AUTO_WRAP_POLICIES, "auto_wrap_policy")
        self.auto_wrap_policy = policy
        if policy == "SIZE_BASED_WRAP" and self.min_num_params is None:
            self.min_num_params = DEFAULT_MIN_NUM_PARAMS

    def _from_fsdp1_policy(self, policy: functools.partial):
        name = getattr(policy.func, "__name__", "")
        if name == "transformer_auto_wrap_policy":
            classes = policy.keywords.get("transformer_layer_cls") or ()
            self.transformer_cls_names_to_wrap = [cls.__name__ for cls in classes]
            return "TRANSFORMER_BASED_WRAP"
        if name == "size_based_auto_wrap_policy":
            self.min_num_params = int(policy.keywords.get("min_num_params", DEFAULT_MIN_NUM_PARAMS))
            return "SIZE_BASED_WRAP"
        if name == "lambda_auto_wrap_policy" and callable(policy.keywords.get("lambda_fn")):
            return policy.keywords["lambda_fn"]
        raise ConfigError(
            f"FullyShardedDataParallelPlugin: auto_wrap_policy={policy!r} is an FSDP1 policy hasten cannot read. "
            "Pass 'TRANSFORMER_BASED_WRAP' with transformer_cls_names_to_wrap, 'SIZE_BASED_WRAP' with min_num_params, "
            "or a callable policy(module) -> bool."
        )

    def _resolve_loading(self) -> None:
        if self.sync_module_states is None:
            self.sync_module_states = bool(self.cpu_ram_efficient_loading)
        if self.cpu_ram_efficient_loading and not self.sync_module_states:
            raise ConfigError(
                "FullyShardedDataParallelPlugin: cpu_ram_efficient_loading=True needs sync_module_states=True "
                "(the weights only exist on process 0 and must be broadcast). Set sync_module_states=True or leave it "
                "unset."
            )

    # ------------------------------------------------------------------------------- public API

    def validate_cpu_offload(self) -> None:
        """Normalise ``cpu_offload`` to a bool or a ``CPUOffloadPolicy`` (reads ``FSDP_OFFLOAD_PARAMS`` when unset)."""
        from torch.distributed.fsdp import CPUOffload, OffloadPolicy

        environment.fill_unset(self, FSDP.rows, fields=("cpu_offload",))
        if isinstance(self.cpu_offload, CPUOffload):
            self.cpu_offload = bool(self.cpu_offload.offload_params)
        if not isinstance(self.cpu_offload, (bool, OffloadPolicy)):
            raise ConfigError(
                f"FullyShardedDataParallelPlugin: cpu_offload={self.cpu_offload!r}; give True/False or a "
                "torch.distributed.fsdp.CPUOffloadPolicy."
            )

    def set_cpu_offload(self) -> None:
        """Re-read ``cpu_offload`` (kept for Accelerate compatibility; the constructor already does it)."""
        self.validate_cpu_offload()

    def validate_mixed_precision_policy(self) -> None:
        """Normalise ``mixed_precision_policy`` to a ``MixedPrecisionPolicy`` (or None), refusing FSDP1-only fields."""
        from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy

        policy = self.mixed_precision_policy
        if policy is None or isinstance(policy, MixedPrecisionPolicy):
            return
        if isinstance(policy, MixedPrecision):
            if policy.buffer_dtype is not None:
                raise _fsdp1_only(
                    "mixed_precision_policy.buffer_dtype",
                    policy.buffer_dtype,
                    "FSDP2 keeps buffers in their own dtype. Leave buffer_dtype unset.",
                )
            policy = {"param_dtype": policy.param_dtype, "reduce_dtype": policy.reduce_dtype}
        if not isinstance(policy, dict):
            raise ConfigError(
                f"FullyShardedDataParallelPlugin: mixed_precision_policy={policy!r}; give a MixedPrecisionPolicy or a "
                "dict of its fields."
            )
        if "buffer_dtype" in policy and policy["buffer_dtype"] is not None:
            raise _fsdp1_only(
                "mixed_precision_policy['buffer_dtype']",
                policy["buffer_dtype"],
                "FSDP2 keeps buffers in their own dtype. Remove buffer_dtype.",
            )
        allowed = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")
        unknown = [k for k in policy if k not in (*allowed, "buffer_dtype")]
        if unknown:
            raise ConfigError(
                f"FullyShardedDataParallelPlugin: mixed_precision_policy has unknown key {unknown[0]!r}; allowed: "
                f"{list(allowed)}.{did_you_mean(unknown[0], allowed)}"
            )
        kwargs = {k: (_dtype(v, k) if k.endswith("dtype") else bool(v)) for k, v in policy.items() if k in allowed}
        self.mixed_precision_policy = MixedPrecisionPolicy(**kwargs)

    def set_mixed_precision(self, mixed_precision, buffer_autocast: bool = False, override: bool = False) -> None:
        """Set the FSDP2 precision policy from ``mixed_precision`` (``"no"``, ``"fp16"``, ``"bf16"``; ``"fp8"`` as
        ``"bf16"``: its float8 layers cast their weights themselves).

        Parameters are all-gathered and used in half precision, while gradients are reduced, and
        accumulated between syncs, in fp32: half the all-gather traffic, no precision lost summing
        gradients across processes. (Accelerate reduces in the half dtype too.) A policy already set is
        kept unless ``override``. ``buffer_autocast`` is FSDP1 only and refused.
        """
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if buffer_autocast:
            raise _fsdp1_only("buffer_autocast", True, "FSDP2 keeps buffers in their own dtype.")
        name = "bf16" if str(mixed_precision).lower() == "fp8" else str(mixed_precision).lower()
        dtype = _DTYPES.get(name) if name in ("fp16", "bf16") else None
        if dtype is None or (self.mixed_precision_policy is not None and not override):
            return
        self.mixed_precision_policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)

    def set_state_dict_type(self, state_dict_type=None) -> None:
        """Set ``state_dict_type`` (None reads ``FSDP_STATE_DICT_TYPE``, default ``SHARDED_STATE_DICT``)."""
        if state_dict_type is None:
            row = FSDP.by_field("state_dict_type")
            state_dict_type = environment.read_setting(row) or row.fallback
        name = _name(state_dict_type, STATE_DICT_TYPES, "state_dict_type")
        if name == "LOCAL_STATE_DICT":
            raise _fsdp1_only(
                "state_dict_type",
                name,
                "use SHARDED_STATE_DICT (per-process shards through torch.distributed.checkpoint) or FULL_STATE_DICT.",
            )
        self.state_dict_type = name

    def set_auto_wrap_policy(self, model: torch.nn.Module) -> None:
        """Resolve the auto wrap policy for ``model``: find the layer classes to wrap, checking that they exist.

        With ``TRANSFORMER_BASED_WRAP`` and no class names, the model's ``_no_split_modules`` (a
        Transformers convention) is used.
        """
        if self.auto_wrap_policy != "TRANSFORMER_BASED_WRAP":
            return
        names = self.transformer_cls_names_to_wrap or list(getattr(model, "_no_split_modules", None) or [])
        if not names:
            raise ConfigError(
                "FullyShardedDataParallelPlugin: auto_wrap_policy='TRANSFORMER_BASED_WRAP' needs the layer classes to "
                "wrap; set transformer_cls_names_to_wrap (launch flag --fsdp_transformer_layer_cls_to_wrap), e.g. "
                "['LlamaDecoderLayer']."
            )
        present = {type(m).__name__ for m in model.modules()}
        for name in names:
            if name not in present:
                raise ConfigError(
                    f"FullyShardedDataParallelPlugin: transformer_cls_names_to_wrap names {name!r}, which is not a "
                    f"module class of this model.{did_you_mean(name, present)} Classes in the model: "
                    f"{sorted(present)[:20]}."
                )
        self.transformer_cls_names_to_wrap = list(names)


def _check_one_argument(policy: Callable) -> None:
    try:
        inspect.signature(policy).bind(torch.nn.Module())
    except TypeError:
        raise ConfigError(
            f"FullyShardedDataParallelPlugin: auto_wrap_policy={policy!r} must be callable as policy(module) -> bool; "
            "FSDP1 policies taking (module, recurse, nonwrapped_numel) are not read, except functools.partial of "
            "transformer_auto_wrap_policy, size_based_auto_wrap_policy or lambda_auto_wrap_policy."
        ) from None
    except ValueError:
        return
