"""Accelerate's Megatron-LM integration (``accelerate.utils.megatron_lm`` and the Megatron-LM dataclasses).

hasten does not drive Megatron-LM: its engines are DDP, FSDP2 and DeepSpeed ZeRO. The names exist with Accelerate's
signatures so that ported code imports; using one raises :class:`~hasten.errors.NotSupportedError` saying so.
``MegatronLMDummyScheduler`` (a plain holder of scheduler settings that Accelerate's examples build) and the
model-config parser registry work as in Accelerate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..errors import NotSupportedError

MODEL_CONFIGS_TO_MEGATRON_PARSERS: dict[str, Callable] = {}


def _refuse(name: str) -> NotSupportedError:
    return NotSupportedError(
        f"{name} belongs to Accelerate's Megatron-LM integration, which hasten does not support. Train with DDP, "
        "FSDP2 (FullyShardedDataParallelPlugin) or DeepSpeed ZeRO (DeepSpeedPlugin) instead."
    )


class MegatronLMDummyScheduler:
    """Holds the scheduler settings (total and warm-up steps) of a scheduler that the engine itself builds.

    Accelerate's examples create it whatever the engine; it only stores its arguments, here as there.
    """

    def __init__(self, optimizer, total_num_steps=None, warmup_num_steps=0, **kwargs):
        self.optimizer = optimizer
        self.total_num_steps = total_num_steps
        self.warmup_num_steps = warmup_num_steps
        self.kwargs = kwargs


def add_model_config_to_megatron_parser(model_type: str):
    """Decorator registering ``function`` as the Megatron-LM config parser of ``model_type``."""

    def register(function: Callable) -> Callable:
        MODEL_CONFIGS_TO_MEGATRON_PARSERS[model_type] = function
        return function

    return register


@dataclass
class MegatronLMPlugin:
    """Accelerate's Megatron-LM settings; not supported by hasten (creating one raises NotSupportedError)."""

    tp_degree: Any = None
    pp_degree: Any = None
    use_custom_fsdp: Any = None
    overlap_cpu_optimizer_d2h_h2d: Any = None
    no_load_optim: Any = None
    eod_mask_loss: Any = None
    no_save_optim: Any = None
    optimizer_cpu_offload: Any = None
    use_precision_aware_optimizer: Any = None
    decoder_last_pipeline_num_layers: Any = None
    recompute_granularity: Any = None
    recompute_method: Any = None
    recompute_num_layers: Any = None
    attention_backend: Any = None
    expert_model_parallel_size: Any = None
    context_parallel_size: Any = None
    attention_dropout: Any = None
    hidden_dropout: Any = None
    attention_softmax_in_fp32: Any = None
    expert_tensor_parallel_size: Any = None
    calculate_per_token_loss: Any = None
    use_rotary_position_embeddings: Any = None
    num_micro_batches: Any = None
    gradient_clipping: Any = None
    sequence_parallelism: Any = None
    recompute_activations: Any = None
    use_distributed_optimizer: Any = None
    pipeline_model_parallel_split_rank: Any = None
    num_layers_per_virtual_pipeline_stage: Any = None
    is_train_batch_min: Any = True
    train_iters: Any = None
    train_samples: Any = None
    weight_decay_incr_style: Any = "constant"
    start_weight_decay: Any = None
    end_weight_decay: Any = None
    lr_decay_style: Any = "linear"
    lr_decay_iters: Any = None
    lr_decay_samples: Any = None
    lr_warmup_iters: Any = None
    lr_warmup_samples: Any = None
    lr_warmup_fraction: Any = None
    min_lr: Any = 0
    consumed_samples: Any = None
    no_wd_decay_cond: Any = None
    scale_lr_cond: Any = None
    lr_mult: Any = 1.0
    megatron_dataset_flag: Any = False
    seq_length: Any = None
    encoder_seq_length: Any = None
    decoder_seq_length: Any = None
    tensorboard_dir: Any = None
    set_all_logging_options: Any = False
    eval_iters: Any = 100
    eval_interval: Any = 1000
    return_logits: Any = False
    custom_train_step_class: Any = None
    custom_train_step_kwargs: Any = None
    custom_model_provider_function: Any = None
    custom_prepare_model_function: Any = None
    custom_megatron_datasets_provider_function: Any = None
    custom_get_batch_function: Any = None
    custom_loss_function: Any = None
    other_megatron_args: Any = None

    def __post_init__(self):
        raise _refuse("MegatronLMPlugin")


class AbstractTrainStep:
    """Not supported by hasten (Megatron-LM); raises NotSupportedError."""

    def __init__(self, name):
        raise _refuse("AbstractTrainStep")


class BertTrainStep:
    """Not supported by hasten (Megatron-LM); raises NotSupportedError."""

    def __init__(self, accelerator, args):
        raise _refuse("BertTrainStep")


class GPTTrainStep:
    """Not supported by hasten (Megatron-LM); raises NotSupportedError."""

    def __init__(self, accelerator, args):
        raise _refuse("GPTTrainStep")


class MegatronEngine:
    """Not supported by hasten (Megatron-LM); raises NotSupportedError."""

    def __init__(self, accelerator, model, optimizer, scheduler):
        raise _refuse("MegatronEngine")


class MegatronLMDummyDataLoader:
    """Not supported by hasten (Megatron-LM); raises NotSupportedError."""

    def __init__(self, **dataset_kwargs):
        raise _refuse("MegatronLMDummyDataLoader")


class MegatronLMOptimizerWrapper:
    """Not supported by hasten (Megatron-LM); raises NotSupportedError."""

    def __init__(self, optimizer):
        raise _refuse("MegatronLMOptimizerWrapper")


class MegatronLMSchedulerWrapper:
    """Not supported by hasten (Megatron-LM); raises NotSupportedError."""

    def __init__(self, scheduler, optimizers):
        raise _refuse("MegatronLMSchedulerWrapper")


class T5TrainStep:
    """Not supported by hasten (Megatron-LM); raises NotSupportedError."""

    def __init__(self, accelerator, args):
        raise _refuse("T5TrainStep")


def avg_losses_across_data_parallel_group(losses):
    """Not supported by hasten (Megatron-LM); raises NotSupportedError."""
    raise _refuse("avg_losses_across_data_parallel_group")


def finish_mpu_init():
    """Not supported by hasten (Megatron-LM); raises NotSupportedError."""
    raise _refuse("finish_mpu_init")


def gather_across_data_parallel_groups(tensor):
    """Not supported by hasten (Megatron-LM); raises NotSupportedError."""
    raise _refuse("gather_across_data_parallel_groups")


def initialize(accelerator, extra_args_provider=None, args_defaults=None):
    """Not supported by hasten (Megatron-LM); raises NotSupportedError."""
    raise _refuse("initialize")


def model_provider_func(pre_process=True, post_process=True, add_encoder=True, add_decoder=True):
    """Not supported by hasten (Megatron-LM); raises NotSupportedError."""
    raise _refuse("model_provider_func")


def prepare_data_loader(accelerator, dataloader):
    """Not supported by hasten (Megatron-LM); raises NotSupportedError."""
    raise _refuse("prepare_data_loader")


def prepare_model_optimizer_scheduler(accelerator):
    """Not supported by hasten (Megatron-LM); raises NotSupportedError."""
    raise _refuse("prepare_model_optimizer_scheduler")


def prepare_optimizer(accelerator, model):
    """Not supported by hasten (Megatron-LM); raises NotSupportedError."""
    raise _refuse("prepare_optimizer")


def prepare_scheduler(accelerator, optimizer, scheduler):
    """Not supported by hasten (Megatron-LM); raises NotSupportedError."""
    raise _refuse("prepare_scheduler")


@add_model_config_to_megatron_parser("megatron-bert")
def parse_bert_config(megatron_lm_plugin, model, batch_data):
    """Not supported by hasten (Megatron-LM); raises NotSupportedError."""
    raise _refuse("parse_bert_config")


@add_model_config_to_megatron_parser("glm4_moe")
def parse_glm4_moe_config(megatron_lm_plugin, model, batch_data):
    """Not supported by hasten (Megatron-LM); raises NotSupportedError."""
    raise _refuse("parse_glm4_moe_config")


@add_model_config_to_megatron_parser("gpt2")
def parse_gpt2_config(megatron_lm_plugin, model, batch_data):
    """Not supported by hasten (Megatron-LM); raises NotSupportedError."""
    raise _refuse("parse_gpt2_config")


@add_model_config_to_megatron_parser("llama")
def parse_llama_config(megatron_lm_plugin, model, batch_data):
    """Not supported by hasten (Megatron-LM); raises NotSupportedError."""
    raise _refuse("parse_llama_config")


@add_model_config_to_megatron_parser("t5")
def parse_t5_config(megatron_lm_plugin, model, batch_data):
    """Not supported by hasten (Megatron-LM); raises NotSupportedError."""
    raise _refuse("parse_t5_config")
