"""The ``parallelism_config`` table: N-D parallelism sizes (``ParallelismConfig``; hasten runs dp_replicate,
dp_shard and tp). Each size row's ``field`` is the ``ParallelismConfig`` field it fills; the context- and
sequence-parallel keys other than the sizes are accepted in the config file only."""

from __future__ import annotations

from . import Section, Setting

_NOT_ABOVE_1 = "size (not supported above 1)"

PARALLELISM = Section(
    name="parallelism_config",
    class_name="ParallelismSection",
    doc="``parallelism_config``: N-D parallelism sizes (``ParallelismConfig``; hasten runs dp_replicate, dp_shard and tp).",
    group="N-D parallelism arguments (ParallelismConfig)",
    rows=(
        Setting(
            "parallelism_config_dp_replicate_size", "int", env_help="ParallelismConfig: data-parallel replicas of the sharded model (HSDP)",
            flag_help="Data-parallel replicas of the sharded model (HSDP).", field="dp_replicate_size", fallback=1,
        ),
        Setting(
            "parallelism_config_dp_shard_size", "int", env_help="ParallelismConfig: processes each parameter is sharded over (FSDP2)",
            flag_help="Processes each parameter is sharded over (FSDP2).", field="dp_shard_size",
        ),
        Setting(
            "parallelism_config_tp_size", "int", env_help="ParallelismConfig: tensor-parallel processes per layer",
            flag_help="Tensor-parallel processes per layer.", field="tp_size", fallback=1,
        ),
        Setting(
            "parallelism_config_cp_size", "int", env_help=f"ParallelismConfig: context-parallel {_NOT_ABOVE_1}",
            flag_help=f"Context-parallel {_NOT_ABOVE_1}.", field="cp_size", fallback=1,
        ),
        Setting("parallelism_config_cp_backend", env=None, flag=None),
        Setting("parallelism_config_cp_comm_strategy", env=None, flag=None),
        Setting(
            "parallelism_config_sp_size", "int", env_help=f"ParallelismConfig: sequence-parallel {_NOT_ABOVE_1}",
            flag_help=f"Sequence-parallel {_NOT_ABOVE_1}.", field="sp_size", fallback=1,
        ),
        Setting("parallelism_config_sp_backend", env=None, flag=None),
        Setting("parallelism_config_sp_seq_length", "int", env=None, flag=None),
        Setting("parallelism_config_sp_seq_length_is_variable", "bool", env=None, flag=None),
        Setting("parallelism_config_sp_attn_implementation", env=None, flag=None),
    ),
)
