"""Recognising and removing the wrappers hasten and torch put around a model (DDP, DeepSpeed, compile, autocast).

FSDP2 adds no wrapper (``fully_shard`` shards the model in place), and the Accelerator's regional compilation
compiles regions in place, so neither needs unwrapping; the twin that
:func:`hasten.runtime.compilation.compile_regions` returns unwraps to the module it was made from.
"""

from __future__ import annotations

import torch

from .precision import Precision


def is_compiled_module(module) -> bool:
    """True for a module returned by ``torch.compile``."""
    if not hasattr(torch, "_dynamo"):
        return False
    return isinstance(module, torch._dynamo.eval_frame.OptimizedModule)


def has_compiled_regions(module: torch.nn.Module) -> bool:
    """True when ``module`` or a module inside it was compiled: a ``torch.compile`` wrapper (as Accelerate's answers,
    ``module`` itself included), or a module compiled in place with ``nn.Module.compile``. Accelerate's answers False
    for the latter, which is how hasten's ``prepare`` compiles regions on every engine (and Accelerate's under FSDP2
    and DeepSpeed)."""
    if not isinstance(module, torch.nn.Module):
        return False
    return any(
        is_compiled_module(sub) or getattr(sub, "_compiled_call_impl", None) is not None for sub in module.modules()
    )


def _inner(model):
    """The module wrapped by one engine wrapper, or None when ``model`` is not such a wrapper."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    if isinstance(model, (DistributedDataParallel, DataParallel)):
        return model.module
    if type(model).__name__ == "DeepSpeedEngine" and hasattr(model, "module"):
        return model.module
    return None


def _compiled_view(compiled, model: torch.nn.Module):
    """A ``torch.compile`` wrapper of ``model`` with the settings of ``compiled`` (made once, then reused).

    Used when the compiled wrapper sits outside an engine wrapper (``torch.compile(DDP(model))``): the
    user's compiled model is then the same compilation applied to the model itself. The training
    wrapper is left untouched.
    """
    view = compiled.__dict__.get("_hasten_unwrapped_view")
    if view is None or view._orig_mod is not model:
        view = torch._dynamo.eval_frame.OptimizedModule(model, compiled.dynamo_ctx)
        compiled.__dict__["_hasten_unwrapped_view"] = view
    return view


def extract_model_from_parallel(
    model, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True, recursive: bool = False
):
    """Return the user's model from inside DDP / DeepSpeed / ``torch.compile`` wrappers.

    Args:
        keep_fp32_wrapper: keep the autocast forward installed by mixed precision (False restores the
            original forward, e.g. for saving or for inference in full precision).
        keep_torch_compile: return the model compiled (a ``torch.compile`` wrapper whose ``_orig_mod`` is
            the user's model, or the twin made by ``compile_regions``) when it was compiled; False returns the
            original module itself, whose ``state_dict()`` keys carry no ``_orig_mod.`` prefix.
        recursive: also unwrap DDP wrappers found inside the model.

    Unlike Accelerate, unwrapping never modifies the wrappers the training loop goes through: when the
    compiled wrapper encloses an engine wrapper (``torch.compile(DDP(model))``), ``keep_torch_compile``
    returns a separate compiled wrapper around the model.
    """
    compiled = None
    regional = model if _is_regional_twin(model) else None
    if regional is not None:
        model = model.__dict__["_orig_mod"]
    while True:
        if is_compiled_module(model):
            compiled = compiled if compiled is not None else model
            model = model._orig_mod
            continue
        inner = _inner(model)
        if inner is None:
            break
        model = inner
    if recursive:
        for name, child in list(model.named_children()):
            unwrapped = extract_model_from_parallel(child, keep_fp32_wrapper, True, recursive=True)
            if unwrapped is not child:
                setattr(model, name, unwrapped)
    if not keep_fp32_wrapper:
        Precision.unwrap_forward(model)
        _restore_original_forward(model)
    if keep_torch_compile and regional is not None:
        return regional
    if keep_torch_compile and compiled is not None:
        return compiled if compiled._orig_mod is model else _compiled_view(compiled, model)
    return model


def _is_regional_twin(model) -> bool:
    """Whether ``model`` was returned by :func:`hasten.runtime.compilation.compile_regions`: a module with compiled
    parts that keeps the module it was made from as ``__dict__["_orig_mod"]``."""
    return (
        isinstance(model, torch.nn.Module)
        and not is_compiled_module(model)
        and "_orig_mod" in model.__dict__
        and has_compiled_regions(model)
    )


def _restore_original_forward(model) -> None:
    """Undo a forward wrapped the way Accelerate's ``prepare_model`` does it: ``model._original_forward`` saved, then
    ``model.forward`` replaced by a wrapper (``convert_outputs_to_fp32``, autocast) whose ``__wrapped__`` chain leads
    back to it."""
    original = model.__dict__.pop("_original_forward", None)
    if original is None:
        return
    if getattr(original, "__self__", None) is model and getattr(original, "__func__", None) is type(model).forward:
        model.__dict__.pop("forward", None)  # the class's own forward again
    else:
        model.forward = original
