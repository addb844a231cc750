"""Sequence parallelism (``ParallelismConfig(sp_size=k)``), engine-neutral: what a strategy asks before it splits a
model's sequences, and the state it keeps.

:func:`check_model` refuses, before training starts, what the split cannot compute correctly (a model without a
transformers config, heads the ``sp`` ranks cannot share, an attention that cannot be split, layers that carry a
state along the sequence) and names the attention that runs on the whole sequence. :class:`SequenceParallel` is the
``sp`` group of a strategy with the backend that splits it: DeepSpeed's Ulysses (``"deepspeed"``, under the DeepSpeed
engine: :mod:`hasten.strategies.deepspeed.ulysses`) or hasten's own (``"accelerate"``: :mod:`hasten.runtime.ulysses`
and :mod:`hasten.data_loader.sequence_sharding`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, NotSupportedError
from .parallelism_handlers import refuse_recurrent_layers

# attention implementations that compute a whole sequence from q, k, v alone (what Ulysses hands them)
_SPLITTABLE = ("sdpa", "flash_attention_2", "flash_attention_3", "flash_attention_4")
_UNSPLITTABLE = ("eager", "paged|eager", "flex_attention")


def _text_config(model) -> Any:
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "get_text_config"):
        raise ConfigError(
            f"Sequence parallelism splits the attention of transformers models, and {type(model).__name__} has no "
            "transformers config (model.config). Prepare a transformers model (AutoModelForCausalLM, ...), or set "
            "sp_size=1."
        )
    return config.get_text_config()


def attention_of(model, requested: str | None) -> str:
    """The attention implementation that computes the whole sequences: ``requested`` (the handler's
    ``sp_attn_implementation``), else the model's own; a :class:`ConfigError` for one Ulysses cannot run."""
    own = getattr(_text_config(model), "_attn_implementation", None)
    name = requested or own
    if name in _UNSPLITTABLE or name is None:
        raise ConfigError(
            f"Sequence parallelism cannot run {name or 'the default'!r} attention ({type(model).__name__} uses "
            f"{own!r}): Ulysses hands the attention whole sequences without a mask, which eager and flex attention "
            "need. Load the model with attn_implementation='sdpa' (or a flash attention), or set "
            "DeepSpeedSequenceParallelConfig(sp_attn_implementation='sdpa')."
        )
    if name not in _SPLITTABLE and "/" not in name:
        raise ConfigError(
            f"sp_attn_implementation={name!r} is not an attention sequence parallelism can split; use one of "
            f"{', '.join(_SPLITTABLE)} or a hub kernel ('kernels-community/flash-attn2')."
        )
    return name


def check_model(model, sp_size: int, requested_attention: str | None) -> str:
    """Refuse ``model`` where ``sp_size`` ranks cannot split its sequences correctly; return the attention
    implementation that runs on the whole sequences (see :func:`attention_of`).

    The query heads must divide among the ranks; the key/value heads too, or the ranks among them (each rank then
    gets a copy of one, as DeepSpeed does). Layers that keep a state along the sequence are refused
    (:func:`~hasten.runtime.parallelism_handlers.refuse_recurrent_layers`)."""
    config = _text_config(model)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if not isinstance(heads, int) or heads % sp_size:
        raise ConfigError(
            f"sp_size={sp_size} does not divide the {heads} attention heads of {type(model).__name__}: Ulysses gives "
            f"each sequence-parallel rank an equal share of the heads. Choose an sp_size that divides {heads}."
        )
    if kv_heads % sp_size and sp_size % kv_heads:
        raise ConfigError(
            f"sp_size={sp_size} and the {kv_heads} key/value heads of {type(model).__name__} do not divide one "
            f"another: each rank needs a whole share of them, or a copy of one. Choose an sp_size that divides "
            f"{kv_heads} or is a multiple of it."
        )
    refuse_recurrent_layers(model)
    return attention_of(model, requested_attention)


@dataclass
class SequenceParallel:
    """The sequence-parallel side of a strategy: ``size`` ranks (consecutive ones) split each sequence.

    Args:
        config: the :class:`~hasten.runtime.parallelism.ParallelismConfig` (its ``sp_handler`` holds the options).
        group: the ``sp`` process group this rank belongs to; ``rank``: this rank's place in it.
    """

    config: Any
    group: Any
    rank: int

    @property
    def size(self) -> int:
        """The ranks that split each sequence."""
        return self.config.sp_size

    @property
    def backend(self) -> str:
        """``"deepspeed"`` or ``"accelerate"`` (settled by the engine)."""
        return self.config.sp_backend

    @property
    def handler(self):
        """The :class:`~hasten.runtime.parallelism_handlers.DeepSpeedSequenceParallelConfig` options."""
        return self.config.sp_handler

    def check(self, model) -> str:
        """:func:`check_model` for this layout; the attention that runs on the whole sequences."""
        return check_model(model, self.size, self.handler.sp_attn_implementation)

    def install(self, model) -> None:
        """Put hasten's Ulysses attention into ``model`` (the ``"accelerate"`` backend)."""
        from .ulysses import install

        attention = self.check(model)
        config = model.config.get_text_config()
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        install(model, attention, self.group, kv_heads)

    def adapt_loader(self, loader, model=None):
        """``loader`` splitting each batch's sequences over the ``sp`` ranks (hasten's adapter; a loader already
        adapted is returned as it is)."""
        from ..data_loader.sequence_sharding import SequenceShardingLoader

        if isinstance(loader, SequenceShardingLoader):
            return loader
        return SequenceShardingLoader(loader, self.rank, self.size, model=model)


def settle_layout(config, engine: str, device_type: str) -> None:
    """Settle a layout for the engine that runs it, before anything is built: the ``sp`` backend (a warning where an
    explicit ``"deepspeed"`` runs hasten's own), the device check (context parallelism is CUDA only), a fixed
    ``sp_seq_length`` the ``sp`` ranks divide."""
    from ..state import warn_once

    if config is None:
        return
    note = config.resolve_sp_backend(engine)
    if note:
        warn_once("sp-backend-fallback", note)
    config.check_supported(device_type)
    if config.sp_enabled and config.tp_enabled:
        raise NotSupportedError(
            f"ParallelismConfig(sp_size={config.sp_size}, tp_size={config.tp_size}): sequence parallelism with "
            "tensor parallelism is not supported (Ulysses would split heads the tensor-parallel split already "
            "divided). Use one of them, with dp_shard_size for the rest."
        )
    length = config.sp_handler.sp_seq_length if config.sp_enabled else None
    if length is not None and int(length) % config.sp_size:
        raise ConfigError(
            f"DeepSpeedSequenceParallelConfig(sp_seq_length={length}) is not divisible by sp_size={config.sp_size}: "
            "each sequence-parallel rank takes an equal part of every sequence. Pad the sequences to a multiple of "
            f"{config.sp_size}."
        )


def sequence_parallel_of(config, mesh) -> SequenceParallel | None:
    """The :class:`SequenceParallel` of a layout laid out on ``mesh`` (None without sequence parallelism)."""
    if config is None or not config.sp_enabled:
        return None
    sp_mesh = mesh["sp"]
    return SequenceParallel(config, sp_mesh.get_group(), sp_mesh.get_local_rank())
