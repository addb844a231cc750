"""Compatibility namespace: the public names of ``accelerate.utils``, re-exported from where they live.

No logic lives here. Names are resolved lazily so importing ``hasten.utils`` stays cheap.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    # operations
    **dict.fromkeys(
        [
            "gather", "gather_object", "broadcast", "broadcast_object_list", "reduce", "pad_across_processes",
            "pad_input_tensors", "send_to_device", "concatenate", "slice_tensors", "find_batch_size",
            "ignorant_find_batch_size", "recursively_apply", "honor_type", "convert_to_fp32", "convert_outputs_to_fp32",
            "listify", "initialize_tensors", "get_data_structure", "find_device", "is_torch_tensor", "is_namedtuple",
            "CannotPadNestedTensorWarning", "ConvertOutputsToFp32",
        ],
        "operations",
    ),
    "DistributedOperationException": "errors",
    # randomness
    "set_seed": "rng",
    "synchronize_rng_state": "rng",
    "synchronize_rng_states": "rng",
    # configuration objects
    **dict.fromkeys(
        [
            "ProjectConfiguration", "DataLoaderConfiguration", "GradientAccumulationPlugin", "DistributedDataParallelKwargs",
            "GradScalerKwargs", "InitProcessGroupKwargs", "AutocastKwargs", "ProfileKwargs", "KwargsHandler", "FP8RecipeKwargs",
        ],
        "plugins",
    ),
    **dict.fromkeys(
        ["DistributedType", "PrecisionType", "RNGType", "LoggerType", "DynamoBackend", "ComputeEnvironment",
         "SageMakerDistributedType", "DDPCommunicationHookType", "CustomDtype", "FP8BackendType", "BaseEnum"],
        "enums",
    ),
    # memory
    "find_executable_batch_size": "memory",
    "release_memory": "memory",
    "should_reduce_batch_size": "memory",
    "clear_device_cache": "memory",
    # environment
    "patch_environment": "environment",
    "clear_environment": "environment",
    "str_to_bool": "environment",
    "check_os_kernel": "environment",
    # models
    "extract_model_from_parallel": "wrappers",
    "is_compiled_module": "wrappers",
    "has_compiled_regions": "wrappers",
    # progress
    "tqdm": "progress",
    # plugins
    "DeepSpeedPlugin": "plugins.deepspeed",
    "DummyOptim": "plugins.deepspeed",
    "DummyScheduler": "plugins.deepspeed",
    "HfDeepSpeedConfig": "plugins.deepspeed",
    "get_active_deepspeed_plugin": "plugins.deepspeed",
    "map_pytorch_optim_to_deepspeed": "plugins.deepspeed",
    "FullyShardedDataParallelPlugin": "plugins.fsdp",
    "TorchDynamoPlugin": "plugins.dynamo",
    "merge_fsdp_weights": "strategies.fsdp_checkpoint",
    "merge_deepspeed_weights": "strategies.deepspeed_checkpoint",
    "compile_regions": "compilation",
    "compile_regions_deepspeed": "compilation",
    "compile_regions_fsdp2": "compilation",
    # big models and serialization
    **dict.fromkeys(
        ["set_module_tensor_to_device", "find_tied_parameters", "retie_parameters", "named_module_tensors", "compute_module_sizes",
         "compute_module_total_buffer_size", "get_max_layer_size", "dtype_byte_size", "get_non_persistent_buffers"],
        "modeling",
    ),
    **dict.fromkeys(["get_max_memory", "get_balanced_memory", "infer_auto_device_map", "check_device_map"], "device_map"),
    **dict.fromkeys(
        ["offload_state_dict", "offload_weight", "save_offload_index", "load_offloaded_weight", "load_offloaded_weights",
         "OffloadedWeightsLoader", "PrefixedDataset", "extract_submodules_state_dict"],
        "offload",
    ),
    "has_offloaded_params": "hooks",
    "align_module_device": "hooks",
    "get_state_dict_offloaded_model": "big_modeling",
    **dict.fromkeys(
        ["load_checkpoint_in_model", "load_state_dict", "MODEL_NAME", "SAFE_MODEL_NAME", "WEIGHTS_NAME", "SAFE_WEIGHTS_NAME",
         "WEIGHTS_INDEX_NAME", "SAFE_WEIGHTS_INDEX_NAME", "WEIGHTS_PATTERN_NAME", "SAFE_WEIGHTS_PATTERN_NAME"],
        "checkpoint_loading",
    ),
    "save": "serialization",
    "load": "serialization",
    "parse_size": "fileio",
    "convert_file_size_to_int": "fileio",
    # launching and configuration
    "write_basic_config": "config",
    "notebook_launcher": "launchers",
    "debug_launcher": "launchers",
    "ParallelismConfig": "unsupported",
    # availability and small helpers
    **dict.fromkeys(
        ["compare_versions", "is_torch_version", "is_cuda_available", "is_mps_available", "is_xpu_available", "is_bf16_available",
         "is_fp16_available", "is_fp8_available", "is_deepspeed_available", "is_tensorboard_available", "is_wandb_available",
         "is_mlflow_available", "is_transformers_available", "is_datasets_available", "is_peft_available", "is_timm_available",
         "is_torchao_available", "is_comet_ml_available", "is_aim_available", "is_clearml_available", "is_dvclive_available",
         "is_swanlab_available", "is_trackio_available",
         "is_bnb_available", "is_torchvision_available", "is_pandas_available", "is_tqdm_available", "is_rich_available",
         "is_safetensors_available", "is_npu_available", "is_mlu_available", "is_sdaa_available", "is_musa_available",
         "is_hpu_available", "is_torch_xla_available"],
        "availability",
    ),
    **dict.fromkeys(["get_pretty_name", "merge_dicts", "is_port_in_use", "convert_bytes", "recursive_getattr"], "misc"),
    **dict.fromkeys(["parse_flag_from_env", "parse_choice_from_env", "get_int_from_env"], "environment"),
    "LocalSGD": "local_sgd",
    # state
    "wait_for_everyone": "utils._process",
}


_RENAMED = {"convert_file_size_to_int": "parse_size"}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hasten.utils' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"hasten.{module}"), _RENAMED.get(name, name))
    globals()[name] = value
    return value


def __dir__():
    return sorted(_EXPORTS)
