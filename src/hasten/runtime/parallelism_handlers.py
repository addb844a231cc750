"""The per-axis options of a ``ParallelismConfig``: ``tp_handler``, ``cp_handler`` and ``sp_handler``.

They hold and check options as Accelerate's classes do, so that a configuration written for Accelerate
builds. hasten runs tensor parallelism; a layout with context or sequence parallelism is refused when an
``Accelerator`` takes it (see :meth:`hasten.runtime.parallelism.ParallelismConfig.check_supported`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .. import environment
from ..errors import ConfigError, NotSupportedError
from ..settings.parallelism import PARALLELISM

CP_COMM_STRATEGIES = ("allgather", "alltoall")
SP_ATTENTION_BUILT_IN = ("flash_attention_2", "flash_attention_3", "sdpa")


def launch_option(name: str, default: Any = None) -> Any:
    """The ``parallelism_config_<name>`` launch setting (``HASTEN_``/``ACCELERATE_``/bare variable), else
    ``default``."""
    value = environment.read_setting(PARALLELISM.by_key(f"parallelism_config_{name}"))
    return default if value is None else value


@dataclass
class TorchTensorParallelConfig:
    """Accelerate's tensor-parallel options, given as ``ParallelismConfig(tp_handler=...)``.

    Asynchronous tensor parallelism (``enable_async_tp=True``, CUDA symmetric memory) is not supported
    and raises :class:`~hasten.errors.NotSupportedError`; plain tensor parallelism needs no options.
    """

    enable_async_tp: Any = False

    def __post_init__(self):
        if self.enable_async_tp:
            raise NotSupportedError(
                "TorchTensorParallelConfig(enable_async_tp=True): asynchronous tensor parallelism is not supported by "
                "hasten; leave it False (tensor parallelism itself works: ParallelismConfig(tp_size=N))."
            )


@dataclass
class TorchContextParallelConfig:
    """Context-parallel options (Accelerate's ``cp_handler``): ``cp_comm_strategy`` is ``"allgather"`` or
    ``"alltoall"``.

    Left unset it comes from the ``parallelism_config_cp_comm_strategy`` launch setting, else ``"allgather"``.
    It builds; hasten refuses a layout with ``cp_size > 1`` when an ``Accelerator`` takes it.
    """

    cp_comm_strategy: str | None = None

    def __post_init__(self):
        if self.cp_comm_strategy is None:
            self.cp_comm_strategy = launch_option("cp_comm_strategy", "allgather")
        if self.cp_comm_strategy not in CP_COMM_STRATEGIES:
            raise ConfigError(
                f"Invalid cp_comm_strategy: {self.cp_comm_strategy}. TorchContextParallelConfig takes one of "
                f"{', '.join(map(repr, CP_COMM_STRATEGIES))}."
            )


@dataclass
class DeepSpeedSequenceParallelConfig:
    """Sequence-parallel options (Accelerate's ``sp_handler``, DeepSpeed Ulysses).

    ``sp_seq_length_is_variable`` defaults to True; when False, ``sp_seq_length`` must be given (or set by the
    launch settings). ``sp_attn_implementation`` is one of flash_attention_2, flash_attention_3, sdpa or a
    hub-hosted flash attention kernel (``"kernels-community/flash-attn2"``). Unset options come from the
    ``parallelism_config_sp_*`` launch settings. It builds; hasten refuses a layout with ``sp_size > 1`` when an
    ``Accelerator`` takes it.
    """

    sp_seq_length: int | None = None
    sp_seq_length_is_variable: bool | None = None
    sp_attn_implementation: str | None = None

    def __post_init__(self):
        if self.sp_seq_length_is_variable is None:
            self.sp_seq_length_is_variable = launch_option("sp_seq_length_is_variable", True)
        if self.sp_seq_length is None:
            self.sp_seq_length = launch_option("sp_seq_length")
        if not self.sp_seq_length_is_variable and self.sp_seq_length is None:
            raise ConfigError(
                "DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=False) needs sp_seq_length, the length of "
                "every batch's sequences: pass it, or set PARALLELISM_CONFIG_SP_SEQ_LENGTH."
            )
        if self.sp_attn_implementation is None:
            self.sp_attn_implementation = launch_option("sp_attn_implementation")
        self._check_attention(self.sp_attn_implementation)

    @staticmethod
    def _check_attention(name: str | None) -> None:
        if name is None or name in SP_ATTENTION_BUILT_IN:
            return
        if name in ("eager", "flex_attention"):
            raise ConfigError(
                f"Invalid sp_attn_implementation: {name}. Sequence parallelism cannot split 'eager' or "
                f"'flex_attention' attention; use one of {', '.join(SP_ATTENTION_BUILT_IN)}."
            )
        if "/" not in name or "flash-attn" not in name:
            raise ConfigError(
                f"Invalid sp_attn_implementation: {name}. Use one of {', '.join(SP_ATTENTION_BUILT_IN)} or a "
                "hub-hosted flash attention kernel such as 'kernels-community/flash-attn2'."
            )


class RecurrentLayersError(ConfigError, ValueError):
    """A model whose layers carry a state along the sequence, given to sequence parallelism."""


def refuse_recurrent_layers(model) -> None:
    """Raise :class:`RecurrentLayersError` (a ``ValueError``) if ``model``'s config lists layers of a linear-attention
    type in ``layer_types``.

    Sequence parallelism (Ulysses) splits the sequence across ranks and gathers it only inside the attention
    interface it wraps. A linear-attention layer computes a running state along the sequence in its own code, so
    every rank would start that state from zero: the first shard's outputs stay right and the gradients silently go
    wrong. A config without ``layer_types`` (or with full-attention layers only) passes. Accelerate's name for this
    check is ``accelerate.big_modeling._refuse_recurrent_layers_under_sequence_parallelism``.
    """
    config = getattr(model, "config", None)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    kinds = sorted({kind for kind in getattr(config, "layer_types", None) or [] if "linear_attention" in kind})
    if kinds:
        raise RecurrentLayersError(
            f"{type(model).__name__} has layers of type {kinds}, which keep a recurrent state along the sequence "
            "outside the attention interface: split across ranks by sequence parallelism, each rank would restart "
            "that state and train on wrong gradients without any error. Use sp_size=1 for this model, or a model "
            "with full attention only."
        )
