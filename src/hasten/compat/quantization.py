"""Accelerate's names of its quantized and FP8 training back ends (``accelerate.utils.ao``, ``.transformer_engine``,
``.bnb`` and their recipe dataclasses).

hasten trains in fp8 through torchao: ``Accelerator(mixed_precision="fp8")``, with ``AORecipeKwargs`` for its settings
(:mod:`hasten.runtime.float8`). The torchao helpers below work (``convert_model_to_fp8_ao``, the layer filters, the
``has_*_layers`` probes, which answer truthfully: a model built without the package has none of its layers); the
Transformer Engine, MS-AMP and bitsandbytes names exist with Accelerate's signatures so that ported code imports,
and raise :class:`~hasten.errors.NotSupportedError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..errors import NotSupportedError
from ..plugins import KwargsHandler
from ..plugins.fp8 import require_torchao
from ..runtime.float8 import default_module_filter, first_and_last_linear, fp8_eligible

_BACKENDS = {"te": "Transformer Engine FP8", "msamp": "MS-AMP", "bnb": "bitsandbytes quantization"}


def _refuse(name: str, backend: str = "bnb") -> NotSupportedError:
    return NotSupportedError(
        f"{name} belongs to Accelerate's {_BACKENDS[backend]} integration, which is not supported by hasten. For FP8 "
        "training use torchao (AO): Accelerator(mixed_precision='fp8'), with AORecipeKwargs for its settings; for "
        "quantized models load them with their library (e.g. transformers' quantization_config) and prepare the result."
    )


def _has_layers_from(model: torch.nn.Module, package: str, class_names: tuple[str, ...] | None = None) -> bool:
    for module in model.modules():
        cls = type(module)
        if cls.__module__.split(".")[0] == package and (class_names is None or cls.__name__ in class_names):
            return True
    return False


def has_ao_layers(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds torchao FP8 linear layers."""
    return _has_layers_from(model, "torchao", ("Float8Linear",))


def has_transformer_engine_layers(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds Transformer Engine layers."""
    return _has_layers_from(model, "transformer_engine")


def has_4bit_bnb_layers(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds bitsandbytes 4-bit linear layers."""
    return _has_layers_from(model, "bitsandbytes", ("Linear4bit",))


def get_parameter_device(parameter: torch.nn.Module) -> torch.device:
    """The device of the first parameter of ``parameter`` (a module)."""
    return next(parameter.parameters()).device


def convert_model_to_fp8_ao(model: torch.nn.Module, config=None, module_filter_func=None) -> None:
    """Swap ``model``'s linear layers for torchao's ``Float8Linear`` in place (Accelerate's helper).

    Args:
        config: a ``torchao.float8.Float8LinearConfig`` (None: torchao's default).
        module_filter_func: ``(module, fqn) -> bool``; None keeps the first and last linear layers and those whose
            sizes are not multiples of 16 in high precision.
    """
    require_torchao("convert_model_to_fp8_ao")
    from torchao.float8 import convert_to_float8_training

    module_filter = module_filter_func or default_module_filter(model)
    convert_to_float8_training(model, module_filter_fn=module_filter, config=config)


def find_first_last_linear_layers(model: torch.nn.Module) -> tuple[str | None, str | None]:
    """The names of the first and the last ``nn.Linear`` of ``model`` (None when it has none)."""
    return first_and_last_linear(model)


def filter_linear_layers(module: torch.nn.Module, fqn: str, layers_to_filter: list[str]) -> bool:
    """FP8 conversion filter: False for a linear layer whose sizes are not multiples of 16 (FP8 kernels need that)
    and for the layers named in ``layers_to_filter``; True otherwise."""
    return fp8_eligible(module, fqn, layers_to_filter)


def filter_first_and_last_linear_layers(module: torch.nn.Module, fqn: str) -> bool:
    """:func:`filter_linear_layers` that also keeps the first and last linear layers of ``module`` out of FP8
    (converting them tends to make training unstable)."""
    return filter_linear_layers(module, fqn, layers_to_filter=list(find_first_last_linear_layers(module)))


def get_keys_to_not_convert(model):
    """Not supported by hasten (bitsandbytes); raises NotSupportedError."""
    raise _refuse("get_keys_to_not_convert")


def get_quantized_model_device_map(
    model, bnb_quantization_config, device_map=None, max_memory=None, no_split_module_classes=None
):
    """Not supported by hasten (bitsandbytes); raises NotSupportedError."""
    raise _refuse("get_quantized_model_device_map")


def load_and_quantize_model(
    model,
    bnb_quantization_config,
    weights_location=None,
    device_map=None,
    no_split_module_classes=None,
    max_memory=None,
    offload_folder=None,
    offload_state_dict=False,
):
    """Not supported by hasten (bitsandbytes); raises NotSupportedError."""
    raise _refuse("load_and_quantize_model")


def quantize_and_offload_8bit(model, param, param_name, new_dtype, offload_folder, offload_index, fp16_statistics):
    """Not supported by hasten (bitsandbytes); raises NotSupportedError."""
    raise _refuse("quantize_and_offload_8bit")


def replace_with_bnb_layers(model, bnb_quantization_config, modules_to_not_convert=None, current_key_name=None):
    """Not supported by hasten (bitsandbytes); raises NotSupportedError."""
    raise _refuse("replace_with_bnb_layers")


def apply_fp8_autowrap(model, fp8_recipe_handler):
    """Not supported by hasten (Transformer Engine); raises NotSupportedError."""
    raise _refuse("apply_fp8_autowrap", "te")


def contextual_fp8_autocast(model_forward, fp8_recipe, use_during_eval=False):
    """Not supported by hasten (Transformer Engine); raises NotSupportedError."""
    raise _refuse("contextual_fp8_autocast", "te")


def convert_model(model, to_transformer_engine=True, _convert_linear=True, _convert_ln=True):
    """Not supported by hasten (Transformer Engine); raises NotSupportedError."""
    raise _refuse("convert_model", "te")


@dataclass
class TERecipeKwargs(KwargsHandler):
    """Transformer Engine FP8 recipe; not supported by hasten (creating one raises NotSupportedError)."""

    use_autocast_during_eval: Any = None
    margin: Any = None
    interval: Any = None
    fp8_format: Any = None
    amax_history_len: Any = None
    amax_compute_algo: Any = None
    override_linear_precision: Any = None
    use_mxfp8_block_scaling: Any = None

    def __post_init__(self):
        raise _refuse("TERecipeKwargs", "te")


@dataclass
class MSAMPRecipeKwargs(KwargsHandler):
    """MS-AMP recipe; not supported by hasten (creating one raises NotSupportedError)."""

    opt_level: Any = None

    def __post_init__(self):
        raise _refuse("MSAMPRecipeKwargs", "msamp")


from .bnb_config import BnbQuantizationConfig  # noqa: E402,F401  (built and checked there; quantizing with it is refused here)
