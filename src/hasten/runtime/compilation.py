"""``torch.compile`` for prepared models: the whole model, or its regions (regional compilation), as Accelerate does.

The regions are Accelerate's: every item of a repeated-blocks list (an ``nn.ModuleList`` whose items are all
instances of the first's class: the decoder layers of a transformer) and, on the way down to such lists, every
other child whole (embeddings, final norm, head). A module with no repeated blocks below it is one region.
Identical blocks share one compiled graph, so compiling regions is much faster than compiling the whole model.

``Accelerator.prepare`` compiles regions in place on every engine (Accelerate does so under FSDP2 and DeepSpeed;
with one process and DDP it returns a twin whose regions are ``torch.compile`` wrappers): the prepared model keeps
its object, its class and its state dict names, with no ``_orig_mod.`` anywhere, and dynamo makes the graphs
Accelerate's twin gives it (:func:`compile_regions_in_place`). Whole-model compilation returns ``torch.compile``'s
wrapper, as Accelerate's does (``unwrap_model`` removes it; state dicts hasten writes use the original names). Where
and how an engine compiles (DeepSpeed's engine compiles its module itself; under FSDP2 the regions get
``nn.Module.compile`` alone and dynamo's flags for checkpointed blocks) is the strategy's ``compile_model``.

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
        The compiled model (``torch.compile``'s wrapper), ``model`` itself compiled in place by region
        (:func:`compile_regions_in_place`), or ``model`` unchanged.
    """
    kwargs = compile_settings(model, dynamo_plugin)
    if kwargs is None:
        return model
    if dynamo_plugin.use_regional_compilation:
        return compile_regions_in_place(model, **kwargs)
    return torch.compile(model, **kwargs)


def compile_settings(model: torch.nn.Module, dynamo_plugin: TorchDynamoPlugin | None) -> dict | None:
    """The keyword arguments of ``torch.compile`` for ``model``, or None when nothing is to be compiled (no plugin,
    backend ``"no"``, disabled, or ``model`` compiled already, wholly or by region); raises
    :class:`~hasten.errors.ConfigError` when the backend is not available."""
    if dynamo_plugin is None or not dynamo_plugin.enabled or is_compiled_module(model) or has_compiled_regions(model):
        return None
    kwargs = dynamo_plugin.compile_kwargs()
    _check_backend(kwargs["backend"])
    return kwargs


def _check_backend(name: str) -> None:
    available = torch._dynamo.list_backends(exclude_tags=())
    if name not in available:
        raise ConfigError(
            f"dynamo_backend={name!r} is not available in this torch build (available: {sorted(available)}); "
            "pick one of those, or install the package that registers it."
        )


def is_repeated_blocks(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a non-empty ``nn.ModuleList`` whose items are all instances of the first item's class
    (subclasses included): blocks that regional compilation compiles one by one, reusing the first one's graph."""
    return (
        isinstance(module, torch.nn.ModuleList)
        and len(module) > 0
        and all(isinstance(item, type(module[0])) for item in module)
    )


def has_repeated_blocks(module: torch.nn.Module) -> bool:
    """Whether ``module`` is or holds repeated blocks (:func:`is_repeated_blocks`) at any depth."""
    return any(is_repeated_blocks(submodule) for submodule in module.modules())


_CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict)


def _regions(module: torch.nn.Module):
    """The regions of ``module``, in module order: each item of a repeated-blocks list; for a module holding repeated
    blocks below it, the regions of each of its children; any other module whole (a model without repeated blocks
    is one region, itself). A container (``nn.ModuleList``, ``nn.ModuleDict``) is never called, so where it would be
    a region its children's regions are taken instead."""
    if is_repeated_blocks(module):
        for block in module.children():
            if isinstance(block, _CONTAINERS):
                yield from _regions(block)
            else:
                yield block
    elif has_repeated_blocks(module) or isinstance(module, _CONTAINERS):
        for child in module.children():
            yield from _regions(child)
    else:
        yield module


def compile_regions_in_place(module: torch.nn.Module, **compile_kwargs) -> torch.nn.Module:
    """Compile each region of ``module`` in place, as ``torch.compile`` wrappers of the regions would be; returns
    ``module``.

    The regions are Accelerate's: each item of a repeated-blocks list (:func:`is_repeated_blocks`) and, on the way
    down to such lists, every other child whole; a model without repeated blocks is compiled whole. Each region gets
    ``nn.Module.compile``, except that a region whose ``forward`` dynamo does not trace on its own (torch's
    ``nn.Embedding``, ``nn.LayerNorm``, ``nn.Linear``, ...) is given the extra frame ``torch.compile(module)`` gives
    it, so that it is compiled as in Accelerate's :func:`compile_regions` twin (``nn.Module.compile`` alone leaves
    such modules running eagerly). The model keeps its object, class, attributes and state dict keys.
    """
    from torch._dynamo import external_utils

    for region in _regions(module):
        if _traced_only_from_a_frame_of_its_own(region):
            region._compiled_call_impl = torch.compile(external_utils.wrap_inline(region._call_impl), **compile_kwargs)
        else:
            region.compile(**compile_kwargs)
    return module


def _traced_only_from_a_frame_of_its_own(module: torch.nn.Module) -> bool:
    """Whether ``torch.compile(module)`` wraps the module in an extra frame: its ``forward`` is one that dynamo's
    trace rules do not start a frame in (torch's own modules), or the extra frame is configured for everyone."""
    from torch._dynamo import config, trace_rules

    forward = module.forward
    return bool(config.wrap_top_frame or (isinstance(forward, MethodType) and trace_rules.check(forward)))


def _compile_each_region(module: torch.nn.Module, compile_kwargs: dict) -> None:
    for region in _regions(module):
        region.compile(**compile_kwargs)


def compile_regions_fsdp2(module: torch.nn.Module, **compile_kwargs) -> torch.nn.Module:
    """Compile each region of ``module`` in place with ``nn.Module.compile``, as Accelerate's does for a model to
    shard with FSDP2 (hooks that ``fully_shard`` adds afterwards still run); returns ``module``.

    The regions are those of :func:`compile_regions_in_place`; as in Accelerate, a region that is one of torch's
    own modules (an embedding, a norm, a head ``nn.Linear``) gets ``nn.Module.compile`` too, which dynamo does not
    trace: it keeps running eagerly.
    """
    _compile_each_region(module, compile_kwargs)
    return module


def compile_regions_deepspeed(module: torch.nn.Module, **compile_kwargs) -> None:
    """Compile each region of ``module`` (the model inside a DeepSpeed engine, ``engine.module``) in place with
    ``nn.Module.compile``, as Accelerate's does: a ``torch.compile`` wrapper would bypass the engine's hooks and
    offloaded parameters. Returns None, as Accelerate's does. The regions, and torch's own modules among them, are
    as in :func:`compile_regions_fsdp2`."""
    _compile_each_region(module, compile_kwargs)


def compile_regions(module: torch.nn.Module, **compile_kwargs) -> torch.nn.Module:
    """A twin of ``module`` whose regions (those of :func:`compile_regions_in_place`) are ``torch.compile``
    wrappers; ``module`` itself is left uncompiled, as Accelerate's ``compile_regions`` does.

    A repeated-blocks list becomes a new ``nn.ModuleList`` of compiled blocks; a module holding repeated blocks
    becomes a new object of its class that shares its attributes (parameters, buffers, hooks, config: the same
    dictionaries), whose methods bound to ``module`` (a patched ``forward``) are bound to the twin and whose children
    are the children's twins; any other module becomes ``torch.compile(module)``. ``twin.__dict__["_orig_mod"]`` is
    ``module``, so ``unwrap_model(twin, keep_torch_compile=False)`` returns it. ``Accelerator.prepare`` compiles in
    place instead (:func:`compile_regions_in_place`), which keeps the model's object and parameter names.

    Unlike Accelerate's, a container (``nn.ModuleList``, ``nn.ModuleDict``) that would be a region (a list of lists
    of blocks, a list of blocks of several classes beside repeated blocks) is split into its children's regions:
    Accelerate's twin wraps it in ``torch.compile``, which cannot be iterated, so the model's forward fails.

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
        return torch.nn.ModuleList(_compiled_block(block, compile_kwargs) for block in module)
    if not (has_repeated_blocks(module) or isinstance(module, _CONTAINERS)):
        return torch.compile(module, **compile_kwargs)
    twin = type(module).__new__(type(module))
    twin.__dict__.update(module.__dict__)
    for name, value in module.__dict__.items():
        if isinstance(value, MethodType) and value.__self__ is module:
            twin.__dict__[name] = MethodType(value.__func__, twin)
    twin.__dict__["_modules"] = {name: _compiled_twin(child, compile_kwargs) for name, child in module.named_children()}
    return twin


def _compiled_block(block: torch.nn.Module, compile_kwargs: dict) -> torch.nn.Module:
    """The twin of one item of a repeated-blocks list: compiled whole, or split when it is a container."""
    if isinstance(block, _CONTAINERS):
        return _compiled_twin(block, compile_kwargs)
    return torch.compile(block, **compile_kwargs)
