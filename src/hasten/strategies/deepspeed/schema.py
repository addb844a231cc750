"""Every key of a DeepSpeed config, so that a misspelled key is an error naming the closest valid one.

Nothing here imports ``deepspeed`` at module level; :func:`installed_schema` reads the installed
DeepSpeed's config models when it is there.
"""

from __future__ import annotations

import copy
import functools
import importlib
import importlib.util
from typing import Any

from ...errors import closest

ANY = "*"  # a section whose keys DeepSpeed passes on unchecked (optimizer params, ...)

_OFFLOAD_PARAM = {k: None for k in ("device", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pin_memory")}
_OFFLOAD_OPTIMIZER = {
    k: None
    for k in (
        "device",
        "nvme_path",
        "buffer_count",
        "pin_memory",
        "pipeline",
        "pipeline_read",
        "pipeline_write",
        "fast_init",
        "ratio",
        "super_offload",
        "cpuadam_cores_perc",
    )
}
_ZERO = {
    **{
        k: None
        for k in (
            "stage",
            "contiguous_gradients",
            "reduce_scatter",
            "reduce_bucket_size",
            "use_multi_rank_bucket_allreduce",
            "allgather_partitions",
            "allgather_bucket_size",
            "overlap_comm",
            "compute_grad_norm",
            "load_from_fp32_weights",
            "elastic_checkpoint",
            "sub_group_size",
            "cpu_offload",
            "cpu_offload_param",
            "cpu_offload_params",
            "cpu_offload_use_pin_memory",
            "prefetch_bucket_size",
            "stage3_prefetch_bucket_size",
            "param_persistence_threshold",
            "stage3_param_persistence_threshold",
            "model_persistence_threshold",
            "stage3_model_persistence_threshold",
            "max_live_parameters",
            "stage3_max_live_parameters",
            "max_reuse_distance",
            "stage3_max_reuse_distance",
            "gather_16bit_weights_on_model_save",
            "stage3_gather_16bit_weights_on_model_save",
            "stage3_gather_fp16_weights_on_model_save",
            "module_granularity_threshold",
            "stage3_module_granularity_threshold",
            "use_all_reduce_for_fetch_params",
            "stage3_use_all_reduce_for_fetch_params",
            "allgather_sequential",
            "stage3_allgather_sequential",
            "ignore_unused_parameters",
            "legacy_stage1",
            "round_robin_gradients",
            "parameter_alignment",
            "zero_hpz_partition_size",
            "zero_quantized_weights",
            "zero_quantized_nontrainable_weights",
            "zero_quantized_gradients",
            "memory_efficient_linear",
            "pipeline_loading_checkpoint",
            "override_module_apply",
            "log_trace_cache_warnings",
            "enable_sanity_checks",
            "save_muon_momentum_buffer_in_memory",
            "mics_shard_size",
            "mics_hierarchical_params_gather",
        )
    },
    "offload_param": _OFFLOAD_PARAM,
    "offload_optimizer": _OFFLOAD_OPTIMIZER,
    "zenflow": ANY,
    "leaf_module": {"classes": None, "names": None, "name_suffixes": None},
}
_FP16 = {
    k: None
    for k in (
        "enabled",
        "auto_cast",
        "loss_scale",
        "initial_scale_power",
        "loss_scale_window",
        "hysteresis",
        "consecutive_hysteresis",
        "min_loss_scale",
        "fp16_master_weights_and_grads",
    )
}
_BF16 = {
    k: None
    for k in (
        "enabled",
        "immediate_grad_update",
        "check_grad_overflow",
        "bf16_master_weights_and_grads",
        "bf16_optimizer_states",
    )
}
_MONITOR = {k: None for k in ("enabled", "output_path", "job_name")}

#: Every key DeepSpeed 0.19 reads, as nested dicts (None: a value, ANY: free-form section).
SCHEMA: dict[str, Any] = {
    **{
        k: None
        for k in (
            "train_batch_size",
            "train_micro_batch_size_per_gpu",
            "gradient_accumulation_steps",
            "steps_per_print",
            "dump_state",
            "wall_clock_breakdown",
            "memory_breakdown",
            "gradient_clipping",
            "prescale_gradients",
            "gradient_predivide_factor",
            "sparse_gradients",
            "communication_data_type",
            "seq_parallel_communication_data_type",
            "gradient_allreduce_op",
            "zero_allow_untested_optimizer",
            "zero_force_ds_cpu_optimizer",
            "disable_allgather",
            "dataloader_drop_last",
            "graph_harvesting",
            "use_data_before_expert_parallelism",
            "managed_gradient_accumulation",
            "disable_python_gc",
            "log_level",
            "vocabulary_size",
            "sequence_parallel_size",
        )
    },
    "optimizer": {"type": None, "params": ANY, "legacy_fusion": None},
    "scheduler": {"type": None, "params": ANY},
    "fp16": _FP16,
    "bf16": _BF16,
    "bfloat16": _BF16,
    "amp": ANY,
    "torch_autocast": {"enabled": None, "dtype": None, "lower_precision_safe_modules": None},
    "zero_optimization": _ZERO,
    "aio": {
        k: None
        for k in (
            "block_size",
            "queue_depth",
            "intra_op_parallelism",
            "thread_count",
            "single_submit",
            "overlap_events",
            "use_gds",
        )
    },
    "activation_checkpointing": {
        k: None
        for k in (
            "partition_activations",
            "cpu_checkpointing",
            "contiguous_memory_optimization",
            "number_checkpoints",
            "synchronize_checkpoint_boundary",
            "profile",
        )
    },
    "flops_profiler": {
        k: None
        for k in (
            "enabled",
            "recompute_fwd_factor",
            "profile_step",
            "module_depth",
            "top_modules",
            "detailed",
            "output_file",
        )
    },
    "checkpoint": {
        "tag_validation": None,
        "load_universal": None,
        "use_node_local_storage": None,
        "parallel_write": ANY,
        "writer": ANY,
        "checkpoint_serialization": None,
    },
    "data_types": {"grad_accum_dtype": None},
    "tensorboard": _MONITOR,
    "csv_monitor": _MONITOR,
    "wandb": {k: None for k in ("enabled", "group", "team", "project")},
    "comet": {
        k: None
        for k in (
            "enabled",
            "samples_log_interval",
            "project",
            "workspace",
            "api_key",
            "experiment_name",
            "experiment_key",
            "online",
            "mode",
        )
    },
    "comms_logger": {k: None for k in ("enabled", "prof_all", "prof_ops", "verbose", "debug")},
    "elasticity": ANY,
    "pipeline": ANY,
    "sparse_attention": ANY,
    "compression_training": ANY,
    "data_efficiency": ANY,
    "curriculum_learning": ANY,
    "quantize_training": ANY,
    "eigenvalue": ANY,
    "progressive_layer_drop": {"enabled": None, "theta": None, "gamma": None},
    "autotuning": ANY,
    "nebula": ANY,
    "compile": ANY,
    "hybrid_engine": ANY,
    "timers": ANY,
    "weight_quantization": ANY,
    "tensor_parallel": ANY,
    "expert_parallel": ANY,
}

# Sections that DeepSpeed describes with pydantic models: their fields (and aliases) are added to the
# schema at run time, so that keys new in the installed DeepSpeed are accepted.
_MODELS = {
    "zero_optimization": ("deepspeed.runtime.zero.config", "DeepSpeedZeroConfig"),
    "zero_optimization.offload_param": ("deepspeed.runtime.zero.offload_config", "DeepSpeedZeroOffloadParamConfig"),
    "zero_optimization.offload_optimizer": (
        "deepspeed.runtime.zero.offload_config",
        "DeepSpeedZeroOffloadOptimizerConfig",
    ),
    "fp16": ("deepspeed.runtime.precision_config", "DeepSpeedFP16Config"),
    "bf16": ("deepspeed.runtime.precision_config", "DeepSpeedBF16Config"),
    "comms_logger": ("deepspeed.comm.config", "CommsLoggerConfig"),
    "tensorboard": ("deepspeed.monitor.config", "TensorBoardConfig"),
    "wandb": ("deepspeed.monitor.config", "WandbConfig"),
    "csv_monitor": ("deepspeed.monitor.config", "CSVConfig"),
    "comet": ("deepspeed.monitor.config", "CometConfig"),
}


@functools.lru_cache(maxsize=1)
def installed_schema() -> dict[str, Any]:
    """:data:`SCHEMA` plus the fields the installed DeepSpeed declares in its config models."""
    schema = copy.deepcopy(SCHEMA)
    if importlib.util.find_spec("deepspeed") is None:
        return schema
    for path, (module_name, class_name) in _MODELS.items():
        try:
            fields = getattr(importlib.import_module(module_name), class_name).model_fields
        except (ImportError, AttributeError):
            continue
        section = _section(schema, path)
        for name, field in fields.items():
            for key in (name, field.alias):
                if key and key not in section:
                    section[key] = None
    return schema


def _section(schema: dict, path: str) -> dict:
    node = schema
    for part in path.split("."):
        node = node[part]
    return node


def unknown_keys(config: dict, schema: dict | None = None, prefix: str = "") -> list[tuple[str, str | None]]:
    """The key paths of ``config`` that DeepSpeed does not know, each with the closest valid key (or None)."""
    schema = installed_schema() if schema is None else schema
    found = []
    for key, value in config.items():
        path = f"{prefix}{key}"
        if key not in schema:
            found.append((path, closest(key, schema)))
        elif isinstance(schema[key], dict) and isinstance(value, dict):
            found.extend(unknown_keys(value, schema[key], f"{path}."))
    return found
