"""Where each name of Accelerate's ``accelerate.utils.<submodule>`` lives in hasten: the one table of the layout.

``LAYOUT[submodule][name]`` is the hasten module that defines ``name`` (``"module:attribute"`` when hasten's name
differs). Each ``hasten/utils/<submodule>.py`` re-exports its row lazily through :func:`reexport`, and
``hasten.utils`` itself re-exports every row, so ``from hasten.utils import X`` and
``from hasten.utils.<submodule> import X`` give the same object. No logic lives here.
"""

from __future__ import annotations

import importlib


def _names(module: str, names: str) -> dict[str, str]:
    return dict.fromkeys(names.split(), module)


_CHECKPOINT_NAMES = _names(
    "runtime.weights.files",
    "MODEL_NAME SAFE_MODEL_NAME WEIGHTS_NAME SAFE_WEIGHTS_NAME WEIGHTS_INDEX_NAME SAFE_WEIGHTS_INDEX_NAME "
    "WEIGHTS_PATTERN_NAME SAFE_WEIGHTS_PATTERN_NAME",
)

LAYOUT: dict[str, dict[str, str]] = {
    "ao": _names(
        "compat.quantization",
        "convert_model_to_fp8_ao filter_first_and_last_linear_layers filter_linear_layers "
        "find_first_last_linear_layers has_ao_layers",
    ),
    "bnb": _names(
        "compat.quantization",
        "get_keys_to_not_convert get_parameter_device get_quantized_model_device_map has_4bit_bnb_layers "
        "load_and_quantize_model quantize_and_offload_8bit replace_with_bnb_layers",
    ),
    "constants": {
        **_CHECKPOINT_NAMES,
        "SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING": "big_modeling.hooks",
        **_names(
            "compat.constants",
            "OPTIMIZER_NAME SCHEDULER_NAME SAMPLER_NAME SCALER_NAME RNG_STATE_NAME FSDP_MODEL_NAME "
            "PROFILE_PATTERN_NAME FSDP_SHARDING_STRATEGY FSDP_AUTO_WRAP_POLICY FSDP_BACKWARD_PREFETCH "
            "FSDP_STATE_DICT_TYPE FSDP2_STATE_DICT_TYPE DEEPSPEED_MULTINODE_LAUNCHERS TORCH_DYNAMO_MODES "
            "STR_OPERATION_TO_FUNC TORCH_LAUNCH_PARAMS CUDA_DISTRIBUTED_TYPES TORCH_DISTRIBUTED_OPERATION_TYPES "
            "FSDP_PYTORCH_VERSION FSDP2_PYTORCH_VERSION DTENSOR_PYTORCH_VERSION "
            "ELASTIC_LOG_LINE_PREFIX_TEMPLATE_PYTORCH_VERSION MITA_PROFILING_AVAILABLE_PYTORCH_VERSION "
            "XPU_PROFILING_AVAILABLE_PYTORCH_VERSION BETA_TP_AVAILABLE_PYTORCH_VERSION "
            "BETA_TP_AVAILABLE_TRANSFORMERS_VERSION BETA_CP_AVAILABLE_PYTORCH_VERSION "
            "BETA_SP_AVAILABLE_DEEPSPEED_VERSION SAGEMAKER_PYTORCH_VERSION SAGEMAKER_PYTHON_VERSION "
            "SAGEMAKER_TRANSFORMERS_VERSION SAGEMAKER_PARALLEL_EC2_INSTANCES",
        ),
    },
    "dataclasses": {
        **_names(
            "plugins",
            "AORecipeKwargs AutocastKwargs DataLoaderConfiguration DistributedDataParallelKwargs FP8RecipeKwargs "
            "GradScalerKwargs GradientAccumulationPlugin InitProcessGroupKwargs KwargsHandler ProfileKwargs "
            "ProjectConfiguration",
        ),
        **_names(
            "enums",
            "BaseEnum ComputeEnvironment CustomDtype DDPCommunicationHookType DistributedType DynamoBackend "
            "FP8BackendType LoggerType PrecisionType RNGType SageMakerDistributedType AmaxComputeAlgorithm Backend "
            "EnumWithContains FP8Format OptLevel ProfilerActivity",
        ),
        "DeepSpeedPlugin": "strategies.deepspeed.plugin",
        "FullyShardedDataParallelPlugin": "strategies.fsdp.plugin",
        "TorchDynamoPlugin": "plugins.dynamo",
        "get_module_class_from_name": "compat.modeling",
        "TensorInformation": "runtime.tree",
        **_names(
            "compat.quantization",
            "TERecipeKwargs MSAMPRecipeKwargs BnbQuantizationConfig",
        ),
        **_names(
            "runtime.parallelism",
            "TorchTensorParallelConfig TorchContextParallelConfig DeepSpeedSequenceParallelConfig",
        ),
        "TorchTensorParallelPlugin": "compat.unsupported",
        **_names(
            "compat.megatron_lm",
            "MegatronLMPlugin MODEL_CONFIGS_TO_MEGATRON_PARSERS add_model_config_to_megatron_parser parse_bert_config "
            "parse_glm4_moe_config parse_gpt2_config parse_llama_config parse_t5_config",
        ),
    },
    "deepspeed": {
        **_names("strategies.deepspeed.dummies", "DummyOptim DummyScheduler map_pytorch_optim_to_deepspeed"),
        "HfDeepSpeedConfig": "strategies.deepspeed.zero3",
        "get_active_deepspeed_plugin": "strategies.deepspeed.plugin",
        **_names("compat.internals", "DeepSpeedEngineWrapper DeepSpeedOptimizerWrapper"),
        "DeepSpeedSchedulerWrapper": "strategies.deepspeed.strategy",
    },
    "environment": {
        **_names(
            "environment",
            "clear_environment get_int_from_env parse_choice_from_env parse_flag_from_env patch_environment "
            "str_to_bool purge_accelerate_environment convert_dict_to_env_variables",
        ),
        **_names(
            "compat.machine_info",
            "are_libraries_initialized "
            "get_cpu_distributed_information CPUInformation override_numa_affinity set_numa_affinity get_gpu_info "
            "get_driver_version check_cuda_p2p_ib_support check_cuda_fp8_capability get_current_device_type",
        ),
    },
    "fsdp_utils": {
        **_names("strategies.fsdp.merging", "merge_fsdp_weights"),
        **_names(
            "strategies.fsdp.checkpoint",
            "save_fsdp_model load_fsdp_model save_fsdp_optimizer load_fsdp_optimizer",
        ),
        **_names(
            "compat.fsdp_helpers",
            "get_parameters_from_modules enable_fsdp_ram_efficient_loading disable_fsdp_ram_efficient_loading "
            "fsdp2_canonicalize_names get_fsdp2_grad_scaler",
        ),
        **_names(
            "compat.internals",
            "ensure_weights_retied fsdp2_apply_ac fsdp2_load_full_state_dict fsdp2_prepare_auto_wrap_policy "
            "fsdp2_prepare_model fsdp2_switch_optimizer_parameters",
        ),
    },
    "imports": {
        "is_rich_available": "compat.unsupported",
        **_names(
            "runtime.availability",
            "USE_TORCH_XLA deepspeed_required torchao_required is_4bit_bnb_available is_8bit_bnb_available "
            "is_aim_available is_amdsmi_available is_bf16_available is_bitsandbytes_multi_backend_available "
            "is_bnb_available is_boto3_available is_clearml_available is_comet_ml_available is_cuda_available "
            "is_datasets_available is_deepspeed_available is_dvclive_available is_fp16_available is_fp8_available "
            "is_habana_gaudi1 is_hpu_available is_import_timer_available is_lomo_available is_matplotlib_available "
            "is_megatron_lm_available is_mlflow_available is_mlu_available is_mps_available is_msamp_available "
            "is_musa_available is_neuron_available is_npu_available is_numpy_available is_pandas_available "
            "is_peft_available is_pippy_available is_pynvml_available is_pytest_available is_rocm_available "
            "is_sagemaker_available is_schedulefree_available is_sdaa_available is_tensorboard_available "
            "is_timm_available is_torch_distributed_available is_torch_xla_available is_torchao_available "
            "is_torchdata_available is_torchdata_stateful_dataloader_available is_torchvision_available "
            "is_tqdm_available is_transformer_engine_available is_transformer_engine_mxfp8_available "
            "is_transformers_available is_triton_available is_wandb_available is_weights_only_available "
            "is_xccl_available is_xpu_available is_safetensors_available is_swanlab_available is_trackio_available",
        ),
    },
    "launch": _names(
        "compat.launch_env",
        "PrepareForLaunch env_var_path_add prepare_deepspeed_cmd_env prepare_extend_env_parallelism_config "
        "prepare_multi_gpu_env prepare_sagemager_args_inputs prepare_simple_launcher_cmd_env prepare_tpu setup_fp8_env",
    ),
    "megatron_lm": _names(
        "compat.megatron_lm",
        "AbstractTrainStep BertTrainStep GPTTrainStep MegatronEngine MegatronLMDummyDataLoader "
        "MegatronLMDummyScheduler MegatronLMOptimizerWrapper MegatronLMSchedulerWrapper T5TrainStep "
        "avg_losses_across_data_parallel_group finish_mpu_init gather_across_data_parallel_groups initialize "
        "model_provider_func prepare_data_loader prepare_model_optimizer_scheduler prepare_optimizer prepare_scheduler",
    ),
    "memory": _names(
        "runtime.memory", "clear_device_cache find_executable_batch_size release_memory should_reduce_batch_size"
    ),
    "modeling": {
        "clean_device_map": "big_modeling.placement",
        "WEIGHTS_INDEX_NAME": "runtime.weights.files",
        "load_checkpoint_in_model": "big_modeling.checkpoint_loading",
        "load_state_dict": "big_modeling.checkpoint_files",
        "align_module_device": "big_modeling.hooks",
        "has_offloaded_params": "big_modeling.hooks",
        "get_state_dict_offloaded_model": "big_modeling",
        "find_tied_parameters": "runtime.weights.tied",
        "load_offloaded_weights": "big_modeling.offload",
        "convert_file_size_to_int": "big_modeling.memory",
        "is_peft_model": "compat.modeling",
        **_names("big_modeling.memory", "get_balanced_memory get_max_memory"),
        **_names("big_modeling.placement", "check_device_map"),
        "infer_auto_device_map": "big_modeling.planner",
        **_names(
            "big_modeling.modeling",
            "compute_module_sizes compute_module_total_buffer_size dtype_byte_size get_max_layer_size retie_parameters",
        ),
        **_names("big_modeling.tensors", "get_non_persistent_buffers named_module_tensors set_module_tensor_to_device"),
        **_names(
            "compat.modeling",
            "calculate_maximum_sizes check_device_same check_tied_parameters_in_config "
            "check_tied_parameters_on_same_device get_module_leaves get_state_dict_from_offload id_tensor_storage "
            "get_grad_scaler get_mixed_precision_context_manager",
        ),
        **_names("compat.internals", "fallback_allocate get_module_size_with_ties"),
    },
    "offload": _names(
        "big_modeling.offload",
        "OffloadedWeightsLoader PrefixedDataset extract_submodules_state_dict load_offloaded_weight offload_state_dict "
        "offload_weight save_offload_index",
    ),
    "operations": {
        "DistributedOperationException": "errors",
        **_names(
            "runtime.operations", "broadcast broadcast_object_list gather gather_object pad_across_processes reduce"
        ),
        **_names(
            "runtime.tree",
            "CannotPadNestedTensorWarning ConvertOutputsToFp32 concatenate convert_outputs_to_fp32 "
            "convert_to_fp32 find_batch_size find_device get_data_structure honor_type ignorant_find_batch_size "
            "initialize_tensors is_namedtuple is_torch_tensor listify pad_input_tensors recursively_apply "
            "send_to_device slice_tensors get_shape is_tensor_information",
        ),
        **_names(
            "compat.operations",
            "TENSOR_INT_TO_DTYPE TENSOR_TYPE_TO_INT verify_operation chained_operation gather_tensor_shape "
            "copy_tensor_to_devices is_torch_xpu_tensor GatheredParameters",
        ),
    },
    "other": {
        "check_os_kernel": "environment",
        "wait_for_everyone": "utils._process",
        **_names(
            "runtime.compilation",
            "compile_regions compile_regions_deepspeed compile_regions_fsdp2 has_repeated_blocks is_repeated_blocks",
        ),
        **_names(
            "compat.misc", "convert_bytes get_pretty_name is_port_in_use merge_dicts recursive_getattr get_free_port"
        ),
        **_names("runtime.wrappers", "extract_model_from_parallel has_compiled_regions is_compiled_module"),
        **_names("compat.modeling", "get_module_children_bottom_up model_has_dtensor get_model_tp_size"),
        **_names("big_modeling.serialization", "load save TORCH_SAFE_GLOBALS"),
        "clean_state_dict_for_safetensors": "compat.modeling",
    },
    "random": _names("runtime.rng", "set_seed synchronize_rng_state synchronize_rng_states"),
    "torch_xla": _names("compat.unsupported", "install_xla"),
    "tqdm": {"tqdm": "runtime.progress"},
    "transformer_engine": _names(
        "compat.quantization", "apply_fp8_autowrap contextual_fp8_autocast convert_model has_transformer_engine_layers"
    ),
    "versions": _names("runtime.availability", "compare_versions is_torch_version torch_version"),
}

# names of ``hasten.utils`` that come from no submodule listed above (``parse_size`` is hasten's own)
FLAT_ONLY: dict[str, str] = {
    "parse_size": "settings.sizes",
    "write_basic_config": "config",
    "notebook_launcher": "launchers",
    "debug_launcher": "launchers",
    "LocalSGD": "local_sgd",
    "ParallelismConfig": "runtime.parallelism",
    "merge_deepspeed_weights": "strategies.deepspeed.checkpoint",
}


def resolve(target: str):
    """The object that ``"module"``/``"module:attribute"`` (relative to ``hasten``) names for a given name."""
    module, _, attribute = target.partition(":")
    return importlib.import_module(f"hasten.{module}"), attribute


def reexport(module_name: str, table: dict[str, str]):
    """``__getattr__``, ``__dir__`` and ``__all__`` of a module that re-exports ``table`` lazily."""

    def __getattr__(name: str):
        target = table.get(name)
        if target is None:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        module, attribute = resolve(target)
        value = getattr(module, attribute or name)
        setattr(importlib.import_module(module_name), name, value)
        return value

    def __dir__():
        return sorted(table)

    return __getattr__, __dir__, sorted(table)
