"""``torch.compile`` for prepared models: the whole model, or each repeated block in place (regional compilation).

Whole-model compilation returns torch's ``OptimizedModule`` wrapper (``unwrap_model`` removes it and
every state dict hasten writes is keyed by the original names). Regional compilation compiles each
block of an ``nn.ModuleList`` of identical layers in place with ``nn.Module.compile``, so the model keeps
its class, its attributes and its parameter names: there is no ``_orig_mod.`` anywhere to strip.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from ..plugins.dynamo import TorchDynamoPlugin
from .wrappers import has_compiled_regions, is_compiled_module


def compile_model(model: torch.nn.Module, dynamo_plugin: TorchDynamoPlugin | None) -> torch.nn.Module:
    """Compile ``model`` as ``dynamo_plugin`` says; models already compiled (wholly or by region) are returned as given.

    Args:
        model: the model after the strategy's setup (DDP-wrapped, FSDP-sharded, or plain).
        dynamo_plugin: the Accelerator's settings; None or backend ``"no"`` compiles nothing.

    Returns:
        The compiled model (``torch.compile``'s wrapper), ``model`` itself compiled in place (regional
        compilation), or ``model`` unchanged.
    """
    if dynamo_plugin is None or not dynamo_plugin.enabled or is_compiled_module(model) or has_compiled_regions(model):
        return model
    kwargs = dynamo_plugin.compile_kwargs()
    _check_backend(kwargs["backend"])
    if dynamo_plugin.use_regional_compilation:
        return compile_regions(model, **kwargs)
    return torch.compile(model, **kwargs)


def _check_backend(name: str) -> None:
    available = torch._dynamo.list_backends(exclude_tags=())
    if name not in available:
        raise ConfigError(
            f"dynamo_backend={name!r} is not available in this torch build (available: {sorted(available)}); "
            "pick one of those, or install the package that registers it."
        )


def _repeated_blocks(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The layers of every ``nn.ModuleList`` made of two or more modules of one class (outermost lists only)."""
    blocks: list[torch.nn.Module] = []
    for child in module.children():
        if isinstance(child, torch.nn.ModuleList) and len(child) > 1 and len({type(layer) for layer in child}) == 1:
            blocks.extend(child)
        else:
            blocks.extend(_repeated_blocks(child))
    return blocks


def compile_regions(module: torch.nn.Module, **compile_kwargs) -> torch.nn.Module:
    """Compile each repeated block of ``module`` in place; the whole module in place when it has none.

    Repeated blocks are the layers of an ``nn.ModuleList`` whose items share one class (the decoder
    layers of a transformer); they are compiled once and the compiled code is reused for every layer,
    so compilation is much faster than for the whole model. Compilation is in place
    (``nn.Module.compile``): ``module`` keeps its class, attributes and state dict keys.

    Args:
        module: the model.
        **compile_kwargs: keyword arguments of ``torch.compile`` (``backend``, ``mode``, ``fullgraph``, ...).

    Returns:
        ``module`` itself.
    """
    blocks = _repeated_blocks(module)
    for block in blocks or [module]:
        block.compile(**compile_kwargs)
    return module


def compile_regions_deepspeed(module: torch.nn.Module, **compile_kwargs) -> torch.nn.Module:
    """:func:`compile_regions` for a model inside a DeepSpeed engine (compilation is in place, so no difference)."""
    return compile_regions(module, **compile_kwargs)


def compile_regions_fsdp2(module: torch.nn.Module, **compile_kwargs) -> torch.nn.Module:
    """:func:`compile_regions` for a model sharded with FSDP2 (compilation is in place, so no difference)."""
    return compile_regions(module, **compile_kwargs)


def is_repeated_blocks(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a non-empty ``nn.ModuleList`` whose items are all of the class of the first one."""
    return (
        isinstance(module, torch.nn.ModuleList)
        and len(module) > 0
        and all(isinstance(m, type(module[0])) for m in module)
    )


def has_repeated_blocks(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds repeated blocks (:func:`is_repeated_blocks`) at any depth: regional compilation
    (:func:`compile_regions`) then compiles one block and reuses it."""
    return any(is_repeated_blocks(submodule) for submodule in module.modules())
