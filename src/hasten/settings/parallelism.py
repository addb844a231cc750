"""The ``parallelism_config`` table: N-D parallelism sizes and options (``ParallelismConfig``, its ``cp_handler`` and
``sp_handler``). Each size row's ``field`` is the ``ParallelismConfig`` field it fills; the backends and the
context/sequence-parallel handlers' options are read by key when left unset. Their flags take Accelerate's values when
left off, and such a value never counts as given (an unset backend is then settled by the engine)."""

from __future__ import annotations

from . import Section, Setting
from .values import str_to_bool

PARALLELISM = Section(
    name="parallelism_config",
    class_name="ParallelismSection",
    doc=(
        "``parallelism_config``: N-D parallelism sizes and options (``ParallelismConfig``: dp_replicate, dp_shard, "
        "tp, sp; cp on CUDA)."
    ),
    group="N-D parallelism arguments (ParallelismConfig)",
    rows=(
        Setting(
            "parallelism_config_dp_replicate_size",
            "int",
            env_help="ParallelismConfig: data-parallel replicas of the sharded model (HSDP)",
            flag_help="Data-parallel replicas of the sharded model (HSDP).",
            flag_default=1,
            field="dp_replicate_size",
            fallback=1,
        ),
        Setting(
            "parallelism_config_dp_shard_size",
            "int",
            env_help="ParallelismConfig: processes each parameter is sharded over (FSDP2)",
            flag_help="Processes each parameter is sharded over (FSDP2).",
            flag_default=1,
            field="dp_shard_size",
        ),
        Setting(
            "parallelism_config_tp_size",
            "int",
            env_help="ParallelismConfig: tensor-parallel processes per layer",
            flag_help="Tensor-parallel processes per layer.",
            flag_default=1,
            field="tp_size",
            fallback=1,
        ),
        Setting(
            "parallelism_config_cp_size",
            "int",
            env_help="ParallelismConfig: context-parallel processes per sequence (ring attention, CUDA only)",
            flag_help="Context-parallel processes per sequence (ring attention; CUDA only).",
            flag_default=1,
            field="cp_size",
            fallback=1,
        ),
        Setting(
            "parallelism_config_cp_backend",
            "choice",
            ("torch",),
            env_help="ParallelismConfig: context-parallel backend (torch)",
            flag_help="Context-parallel backend: torch (FSDP2).",
            flag_default="torch",
        ),
        Setting(
            "parallelism_config_cp_comm_strategy",
            env_help="TorchContextParallelConfig: allgather or alltoall",
            flag_help="How context-parallel ranks exchange keys and values: allgather or alltoall.",
            flag_default="allgather",
        ),
        Setting(
            "parallelism_config_sp_size",
            "int",
            env_help="ParallelismConfig: sequence-parallel (Ulysses) processes per sequence",
            flag_help="Sequence-parallel (Ulysses) processes per sequence.",
            flag_default=1,
            field="sp_size",
            fallback=1,
        ),
        Setting(
            "parallelism_config_sp_backend",
            "choice",
            ("deepspeed", "accelerate"),
            env_help="ParallelismConfig: sequence-parallel backend (deepspeed, or accelerate: hasten's own Ulysses)",
            flag_help="Sequence-parallel backend: deepspeed (DeepSpeed's ALST/Ulysses) or accelerate (hasten's own "
            "Ulysses, for DDP and FSDP2). Left off: deepspeed under DeepSpeed, else accelerate.",
            flag_default="deepspeed",
        ),
        Setting(
            "parallelism_config_sp_seq_length",
            "int",
            env_help="DeepSpeedSequenceParallelConfig: fixed sequence length",
            flag_help="The sequence length of every batch, when it is fixed (see sp_seq_length_is_variable).",
            flag_type=str,
        ),
        Setting(
            "parallelism_config_sp_seq_length_is_variable",
            "bool",
            env_help="DeepSpeedSequenceParallelConfig: sequence lengths vary between batches",
            flag_help="Whether the sequence length may change between batches (default true); false needs "
            "sp_seq_length.",
            flag_default=True,
            flag_type=str_to_bool,
        ),
        Setting(
            "parallelism_config_sp_attn_implementation",
            env_help="DeepSpeedSequenceParallelConfig: attention implementation",
            flag_help="The attention the sequence-parallel wrapper runs: sdpa, flash_attention_2, flash_attention_3 or "
            "a hub kernel; left off: the model's own.",
            flag_default="sdpa",
        ),
    ),
)


def splits_sequences_only(layout) -> bool:
    """Whether a ``ParallelismConfig`` splits sequences (``sp_size`` above 1) without sharding or splitting parameters
    (``dp_shard_size`` and ``tp_size`` unset or 1): such a layout runs under DDP when nothing else asks for an engine;
    any other asks for FSDP2. Reads the sizes only (no torch)."""
    return (layout.sp_size or 1) > 1 and (layout.dp_shard_size or 1) == 1 and (layout.tp_size or 1) == 1


def asks_for_fsdp(layout) -> bool:
    """The FSDP2 registration's ``Argument.layout``: every layout but one that splits sequences only."""
    return not splits_sequences_only(layout)


def asks_for_no_engine(layout) -> bool:
    """The ``Argument.layout`` of an engine that takes the layout but is never chosen by it (DeepSpeed: asked for by
    its plugin, switch or launch settings; ``sp_backend='deepspeed'`` alone runs hasten's Ulysses under DDP/FSDP2)."""
    return False
