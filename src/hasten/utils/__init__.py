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
    # state
    "wait_for_everyone": "utils._process",
}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hasten.utils' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"hasten.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(_EXPORTS)
