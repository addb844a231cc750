"""Model-inspection helpers of ``accelerate.utils.modeling`` and ``.other`` that hasten's own code does not need but
libraries built on Accelerate call: sizes, tied weights, device comparison, storage identity, grad scalers.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from typing import Mapping

import torch
from torch import nn

from ..big_modeling.modeling import compute_module_sizes, get_max_layer_size
from ..big_modeling.placement import check_tied_parameters_on_same_device  # noqa: F401 (Accelerate's name)


def calculate_maximum_sizes(model: nn.Module) -> tuple[int, tuple[int, list[str]]]:
    """``(total size in bytes, (size of the largest unsplittable layer, its names))`` of ``model``.

    Layers whose class is in ``model._no_split_modules`` count as one piece.
    """
    sizes = compute_module_sizes(model)
    no_split = getattr(model, "_no_split_modules", None) or []
    top = (
        list(model.named_parameters(recurse=False))
        + list(model.named_children())
        + list(model.named_buffers(recurse=False))
    )
    return sizes[""], get_max_layer_size(top, sizes, no_split)


def check_device_same(first_device, second_device) -> bool:
    """Whether two devices are the same, treating ``cuda`` and ``cuda:0`` (the current device) as equal."""
    first, second = torch.device(first_device), torch.device(second_device)
    if first.type != second.type:
        return False
    if first.type == "cpu":
        return True
    return (first.index or 0) == (second.index or 0)


def check_tied_parameters_in_config(model: nn.Module) -> bool:
    """Whether a transformers model's config asks for tied weights (word embeddings, encoder/decoder or modules
    with ``_tie_weights``); False for any other model."""
    if "PreTrainedModel" not in [cls.__name__ for cls in inspect.getmro(type(model))]:
        return False
    config = getattr(model, "config", None)
    text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    word_embeddings = bool(
        text_config is not None and getattr(text_config, "tie_word_embeddings", False) and model.get_output_embeddings()
    )
    encoder_decoder = bool(
        getattr(config, "is_encoder_decoder", False) and getattr(config, "tie_encoder_decoder", False)
    )
    return word_embeddings or encoder_decoder or any(hasattr(module, "_tie_weights") for module in model.modules())


def get_module_leaves(module_sizes: Mapping[str, int]) -> list[str]:
    """The names in ``module_sizes`` (output of ``compute_module_sizes``) that have no child in it."""
    parents = {name.rsplit(".", 1)[0] for name in module_sizes if "." in name}
    return [name for name in module_sizes if name != "" and name not in parents]


def id_tensor_storage(tensor: torch.Tensor) -> tuple[torch.device, int, int]:
    """An identifier of ``tensor``'s storage, equal for tensors sharing memory: ``(device, address, size)``."""
    storage = tensor.untyped_storage()
    return tensor.device, storage.data_ptr(), storage.nbytes()


def get_state_dict_from_offload(
    module: nn.Module, module_name: str, state_dict: dict, device_to_put_offload="cpu"
) -> dict:
    """Add ``module``'s weights to ``state_dict`` under ``module_name``, bringing offloaded weights to
    ``device_to_put_offload`` first; returns ``state_dict``."""
    from ..big_modeling.hooks import align_module_device

    with align_module_device(module, device_to_put_offload):
        for name, tensor in module.state_dict().items():
            state_dict[f"{module_name}.{name}" if module_name else name] = tensor.to(device_to_put_offload)
    return state_dict


def clean_state_dict_for_safetensors(state_dict: dict) -> dict:
    """``state_dict`` ready for safetensors: of tensors sharing memory only the first name is kept, and every
    tensor is contiguous."""
    seen: set = set()
    cleaned = {}
    for name, tensor in state_dict.items():
        if isinstance(tensor, torch.Tensor):
            key = id_tensor_storage(tensor)
            if key in seen and tensor.numel() > 0:
                continue
            seen.add(key)
            tensor = tensor.contiguous()
        cleaned[name] = tensor
    return cleaned


def get_grad_scaler(distributed_type=None, **kwargs) -> torch.amp.GradScaler:
    """A gradient scaler for fp16 training on this machine's accelerator (``kwargs`` go to ``GradScaler``).
    ``distributed_type`` is accepted for Accelerate's signature: hasten's FSDP2 and DDP use the same scaler."""
    from ..environment import accelerator_type

    device = accelerator_type()
    return torch.amp.GradScaler(device if device in ("cuda", "xpu") else "cpu", **kwargs)


def get_mixed_precision_context_manager(native_amp: bool = False, autocast_kwargs=None):
    """``torch.autocast`` for the mixed precision in force (fp16/bf16; bf16 under fp8) when ``native_amp``, else a
    no-op context.

    ``autocast_kwargs`` is an ``AutocastKwargs``; the state must exist (an ``Accelerator`` was created).
    """
    if not native_amp:
        return contextlib.nullcontext()
    from ..state import AcceleratorState

    state = AcceleratorState()
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.bfloat16}.get(str(state.mixed_precision))
    if dtype is None:
        return contextlib.nullcontext()
    extra = autocast_kwargs.autocast_kwargs() if autocast_kwargs is not None else {}
    return torch.autocast(device_type=state.device.type, dtype=dtype, **extra)


def get_module_class_from_name(module: nn.Module, name: str) -> type | None:
    """The class called ``name`` among ``module`` and its submodules (depth first), or None.

    Used to turn class names from a config (``fsdp_transformer_layer_cls_to_wrap``) into classes.
    """
    if type(module).__name__ == name:
        return type(module)
    for child in module.children():
        found = get_module_class_from_name(child, name)
        if found is not None:
            return found
    return None


def is_peft_model(model) -> bool:
    """Whether ``model``, once hasten's and torch's wrappers are removed, is a peft ``PeftModel``.

    peft is not imported here: a ``PeftModel`` can only exist once peft is imported, so without it the answer is False.
    """
    from ..runtime.wrappers import extract_model_from_parallel

    peft = sys.modules.get("peft")
    return peft is not None and isinstance(extract_model_from_parallel(model), peft.PeftModel)


def get_module_children_bottom_up(model: nn.Module, return_fqns: bool = False) -> list:
    """Every submodule of ``model``, children before their parents, ``model`` itself last (as ``(name, module)``
    pairs with ``return_fqns``)."""
    ordered = []
    stack = [("", model)]
    while stack:
        name, module = stack.pop()
        ordered.append((name, module) if return_fqns else module)
        stack.extend(
            (f"{name}.{child_name}" if name else child_name, child) for child_name, child in module.named_children()
        )
    return ordered[::-1]


def model_has_dtensor(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` is a ``DTensor`` (the model was sharded by FSDP2 or tensor parallelism)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(parameter, DTensor) for parameter in model.parameters())


def get_model_tp_size(model: nn.Module) -> int | None:
    """The tensor-parallel degree a transformers model was sharded with (``model.tp_size`` or the config's
    ``distributed_config``), or None."""
    tp_size = getattr(model, "tp_size", None)
    if tp_size is not None:
        return tp_size
    distributed = getattr(getattr(model, "config", None), "distributed_config", None)
    if isinstance(distributed, dict):
        return distributed.get("tp_size")
    return getattr(distributed, "tp_size", None)
