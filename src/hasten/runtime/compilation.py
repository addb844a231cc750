"""``torch.compile`` for prepared models: the whole model, or each repeated block in place (regional compilation).

Whole-model compilation returns torch's ``OptimizedModule`` wrapper (``unwrap_model`` removes it and
every state dict hasten writes is keyed by the original names). The Accelerator's regional compilation
compiles each block of an ``nn.ModuleList`` of identical layers in place with ``nn.Module.compile``, so the
model keeps its class, its attributes and its parameter names: there is no ``_orig_mod.`` anywhere to strip.
:func:`compile_regions`, called by hand, returns a compiled twin of the model as Accelerate's does.
"""

from __future__ import annotations

from types import MethodType

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
        return _compile_in_place(model, **kwargs)
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
    """A twin of ``module`` whose repeated blocks are compiled, each on its own (the whole twin compiled when it
    has none); ``module`` itself is left as it was.

    Repeated blocks are the items of an ``nn.ModuleList`` of one class (:func:`is_repeated_blocks`, the decoder
    layers of a transformer): each becomes a ``torch.compile`` wrapper, and the compiled code of the first is
    reused for the others, so compilation is much faster than for the whole model. The twin is a new object of
    ``module``'s class that shares its parameters, buffers and attributes; methods bound to ``module`` (a
    patched ``forward``) are bound to the twin, and ``twin.__dict__["_orig_mod"]`` is ``module``, so
    ``unwrap_model(twin, keep_torch_compile=False)`` returns it. ``Accelerator.prepare`` compiles in place instead
    (:func:`compile_regions_fsdp2`), which keeps the model's object and parameter names.

    Args:
        module: the model.
        **compile_kwargs: keyword arguments of ``torch.compile`` (``backend``, ``mode``, ``fullgraph``, ...).

    Returns:
        The twin (``torch.compile``'s wrapper of ``module`` when it holds no repeated blocks).
    """
    twin = _compiled_twin(module, compile_kwargs)
    twin.__dict__.setdefault("_orig_mod", module)
    return twin


def _compiled_twin(module: torch.nn.Module, compile_kwargs: dict) -> torch.nn.Module:
    if is_repeated_blocks(module):
        return torch.nn.ModuleList(torch.compile(block, **compile_kwargs) for block in module)
    if not has_repeated_blocks(module):
        return torch.compile(module, **compile_kwargs)
    twin = type(module).__new__(type(module))
    twin.__dict__.update(module.__dict__)
    for name, value in module.__dict__.items():
        if isinstance(value, MethodType) and value.__self__ is module:
            twin.__dict__[name] = MethodType(value.__func__, twin)
    twin.__dict__["_parameters"] = dict(module._parameters)
    twin.__dict__["_buffers"] = dict(module._buffers)
    twin.__dict__["_modules"] = {
        name: None if child is None else _compiled_twin(child, compile_kwargs)
        for name, child in module._modules.items()
    }
    return twin


def _compile_in_place(module: torch.nn.Module, **compile_kwargs) -> torch.nn.Module:
    """Compile each repeated block of ``module`` in place (``nn.Module.compile``), the whole module when it has
    none: ``module`` keeps its class, attributes and state dict keys."""
    blocks = _repeated_blocks(module)
    for block in blocks or [module]:
        block.compile(**compile_kwargs)
    return module


def compile_regions_deepspeed(module: torch.nn.Module, **compile_kwargs) -> torch.nn.Module:
    """Regional compilation in place, for a model inside a DeepSpeed engine: each repeated block of ``module`` (the
    whole module when it has none) is compiled with ``nn.Module.compile``; returns ``module``."""
    return _compile_in_place(module, **compile_kwargs)


def compile_regions_fsdp2(module: torch.nn.Module, **compile_kwargs) -> torch.nn.Module:
    """Regional compilation in place, for a model sharded with FSDP2 (hooks that ``fully_shard`` adds later still
    run): each repeated block of ``module`` (the whole module when it has none) is compiled with
    ``nn.Module.compile``; returns ``module``."""
    return _compile_in_place(module, **compile_kwargs)


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
