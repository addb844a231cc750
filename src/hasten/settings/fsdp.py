"""The ``fsdp_config`` table: the settings of fully sharded data parallel training (hasten runs FSDP2).

Rows are in the order of the ``hasten launch`` options; the two rows without a config key are only
read from the environment. Each row's ``field`` is the ``FullyShardedDataParallelPlugin`` field it fills.
"""

from __future__ import annotations

from . import Question, Section, Setting

FSDP_SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
# FSDP1's sharding strategy -> FSDP2's reshard_after_forward that does the same.
FSDP_RESHARD_AFTER_FORWARD = {
    "FULL_SHARD": True,
    "SHARD_GRAD_OP": False,
    "NO_SHARD": False,
    "HYBRID_SHARD": True,
    "HYBRID_SHARD_ZERO2": False,
}
# FSDP1's keys that FSDP2 has no use for (Accelerate's to-fsdp2 drops them).
FSDP1_ONLY_KEYS = ("fsdp_backward_prefetch", "fsdp_forward_prefetch", "fsdp_sync_module_states", "fsdp_use_orig_params")
FSDP_AUTO_WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
FSDP_BACKWARD_PREFETCH = ("BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH")
FSDP_STATE_DICT_TYPES = ("FULL_STATE_DICT", "LOCAL_STATE_DICT", "SHARDED_STATE_DICT")
_WRAP = "fsdp_auto_wrap_policy"

FSDP = Section(
    name="fsdp_config",
    class_name="FsdpSection",
    doc="``fsdp_config``: fully sharded data parallel settings (hasten runs FSDP2).",
    group="FSDP arguments",
    only_with="FSDP",
    rows=(
        Setting(
            "fsdp_version",
            "choice",
            (1, 2),
            env_help="FSDP version (hasten supports 2)",
            flag_help="FSDP version (hasten runs FSDP2).",
            flag_default="1",
            field="fsdp_version",
            fallback=2,
            question=Question(default=2, fixed=True),
        ),
        Setting(
            "fsdp_offload_params",
            "bool",
            env_help="offload parameters to the CPU",
            flag_help="Offload parameters to the CPU.",
            flag_default="false",
            field="cpu_offload",
            fallback=False,
            question=Question("Do you want to offload parameters and gradients to CPU?", step=2),
        ),
        Setting(
            "fsdp_min_num_params",
            "int",
            env_help="size threshold of SIZE_BASED_WRAP",
            flag_help="Size threshold of SIZE_BASED_WRAP.",
            flag_default=100000000,
            field="min_num_params",
            question=Question(
                "What should be your FSDP's minimum number of parameters for Default Auto Wrapping Policy?",
                100000000,
                step=5,
                when=(_WRAP, ("SIZE_BASED_WRAP",)),
            ),
        ),
        Setting(
            "fsdp_sharding_strategy",
            "choice",
            FSDP_SHARDING_STRATEGIES,
            env_help="FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD",
            flag_help="Sharding strategy.",
            flag_default="FULL_SHARD",
            field="sharding_strategy",
        ),
        Setting(
            "fsdp_reshard_after_forward",
            "bool_or_strategy",
            FSDP_SHARDING_STRATEGIES,
            env_help="reshard parameters after forward",
            flag_help="Reshard parameters after forward.",
            flag_default="true",
            field="reshard_after_forward",
            question=Question(
                "Do you want to reshard the parameters after the forward pass (less memory, like FULL_SHARD)?",
                True,
                step=1,
            ),
        ),
        Setting(
            _WRAP,
            "choice",
            FSDP_AUTO_WRAP_POLICIES,
            env_help="TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP or NO_WRAP",
            flag_help="Auto wrap policy.",
            field="auto_wrap_policy",
            question=Question("What should be your auto wrap policy?", "TRANSFORMER_BASED_WRAP", step=3),
        ),
        Setting(
            "fsdp_transformer_layer_cls_to_wrap",
            env="FSDP_TRANSFORMER_CLS_TO_WRAP",
            env_help="comma-separated layer class names to shard one by one",
            flag_help="Comma-separated layer class names to shard one by one.",
            field="transformer_cls_names_to_wrap",
            question=Question(
                "Specify the comma-separated list of transformer layer class names (case-sensitive) to wrap, e.g. "
                "BertLayer,T5Block (empty: the model's _no_split_modules)",
                "",
                step=4,
                when=(_WRAP, ("TRANSFORMER_BASED_WRAP",)),
            ),
        ),
        Setting(
            "fsdp_backward_prefetch",
            "choice",
            FSDP_BACKWARD_PREFETCH,
            env_help="FSDP1 setting; FSDP2 prefetches by itself",
            flag_help="Backward prefetch (FSDP1).",
            field="backward_prefetch",
        ),
        Setting(
            "fsdp_state_dict_type",
            "choice",
            FSDP_STATE_DICT_TYPES,
            env_help="FULL_STATE_DICT or SHARDED_STATE_DICT",
            flag_help="State dict type.",
            field="state_dict_type",
            fallback="SHARDED_STATE_DICT",
            question=Question(
                "What should be your FSDP's state dict type?",
                "SHARDED_STATE_DICT",
                step=6,
                options=("FULL_STATE_DICT", "SHARDED_STATE_DICT"),
            ),
        ),
        Setting(
            "fsdp_forward_prefetch",
            "bool",
            env_help="FSDP1 setting; FSDP2 prefetches by itself",
            flag_help="Forward prefetch (FSDP1).",
            flag_default="false",
            field="forward_prefetch",
            fallback=False,
        ),
        Setting(
            "fsdp_use_orig_params",
            "bool",
            env_help="FSDP1 setting; FSDP2 always uses the original parameters",
            flag_help="use_orig_params (FSDP1).",
            flag_default="true",
            field="use_orig_params",
        ),
        Setting(
            "fsdp_cpu_ram_efficient_loading",
            "bool",
            env_help="rank 0 loads the weights, the others start on meta",
            flag_help="Rank 0 loads the weights, the others start empty.",
            flag_default="true",
            field="cpu_ram_efficient_loading",
            fallback=False,
            question=Question(
                "Do you want to enable CPU RAM efficient model loading? Only applicable for 🤗 Transformers models.",
                True,
                step=7,
            ),
        ),
        Setting(
            "fsdp_sync_module_states",
            "bool",
            env_help="broadcast rank 0's weights at setup",
            flag_help="Broadcast rank 0's weights at setup.",
            flag_default="true",
            field="sync_module_states",
            question=Question(default=True, step=8, fixed=True),
        ),
        Setting(
            "fsdp_activation_checkpointing",
            "bool",
            env_help="recompute activations of wrapped layers in backward",
            flag_help="Recompute activations in backward.",
            flag_default="false",
            field="activation_checkpointing",
            fallback=False,
            question=Question("Do you want to enable FSDP activation checkpointing?", step=9),
        ),
        Setting(
            None,
            "bool",
            env="FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD",
            env_help="offload checkpointed activations (not supported)",
            flag=None,
            field="activation_checkpointing_offload",
            fallback=False,
        ),
        Setting(
            None, env="FSDP_IGNORED_MODULES", env_help="modules FSDP leaves alone", flag=None, field="ignored_modules"
        ),
    ),
)
