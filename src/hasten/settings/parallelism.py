"""The ``parallelism_config`` table: N-D parallelism sizes (``ParallelismConfig``; hasten runs dp_replicate,
dp_shard and tp). Each size row's ``field`` is the ``ParallelismConfig`` field it fills (a size set this way
chooses FSDP); the backends and the context/sequence-parallel handlers' options are read by key when left
unset, and have no launch flag."""

from __future__ import annotations

from . import Section, Setting

_NOT_ABOVE_1 = "size (not supported above 1)"

PARALLELISM = Section(
    name="parallelism_config",
    class_name="ParallelismSection",
    doc=(
        "``parallelism_config``: N-D parallelism sizes (``ParallelismConfig``; hasten runs dp_replicate, dp_shard "
        "and tp)."
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
            env_help=f"ParallelismConfig: context-parallel {_NOT_ABOVE_1}",
            flag_help=f"Context-parallel {_NOT_ABOVE_1}.",
            flag_default=1,
            field="cp_size",
            fallback=1,
        ),
        Setting(
            "parallelism_config_cp_backend",
            env_help="ParallelismConfig: context-parallel backend (torch)",
            flag=None,
        ),
        Setting(
            "parallelism_config_cp_comm_strategy",
            env_help="TorchContextParallelConfig: allgather or alltoall",
            flag=None,
        ),
        Setting(
            "parallelism_config_sp_size",
            "int",
            env_help=f"ParallelismConfig: sequence-parallel {_NOT_ABOVE_1}",
            flag_help=f"Sequence-parallel {_NOT_ABOVE_1}.",
            flag_default=1,
            field="sp_size",
            fallback=1,
        ),
        Setting(
            "parallelism_config_sp_backend",
            env_help="ParallelismConfig: sequence-parallel backend (deepspeed)",
            flag=None,
        ),
        Setting(
            "parallelism_config_sp_seq_length",
            "int",
            env_help="DeepSpeedSequenceParallelConfig: fixed sequence length",
            flag=None,
        ),
        Setting(
            "parallelism_config_sp_seq_length_is_variable",
            "bool",
            flag=None,
            env_help="DeepSpeedSequenceParallelConfig: sequence lengths vary between batches",
        ),
        Setting(
            "parallelism_config_sp_attn_implementation",
            flag=None,
            env_help="DeepSpeedSequenceParallelConfig: attention implementation",
        ),
    ),
)
