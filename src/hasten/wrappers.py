"""Recognising and removing the wrappers hasten and torch put around a model (DDP, FSDP, DeepSpeed, compile, autocast)."""

from __future__ import annotations

import torch

from .precision import Precision


def is_compiled_module(module) -> bool:
    """True for a module returned by ``torch.compile``."""
    return isinstance(module, torch._dynamo.eval_frame.OptimizedModule) if hasattr(torch, "_dynamo") else False


def has_compiled_regions(module: torch.nn.Module) -> bool:
    """True when some submodule of ``module`` was compiled on its own (regional compilation)."""
    return any(is_compiled_module(m) for m in module.modules() if m is not module)


def _inner(model):
    """The module wrapped by one engine wrapper, or None when ``model`` is not such a wrapper."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    if isinstance(model, (DistributedDataParallel, DataParallel)):
        return model.module
    if type(model).__name__ == "DeepSpeedEngine" and hasattr(model, "module"):
        return model.module
    return None


def extract_model_from_parallel(model, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True, recursive: bool = False):
    """Return the user's model from inside DDP / DeepSpeed / compile wrappers.

    Args:
        keep_fp32_wrapper: keep the autocast forward installed by mixed precision (False restores the
            original forward, e.g. for saving or for inference in full precision).
        keep_torch_compile: return the compiled module rather than the original.
        recursive: also unwrap DDP wrappers found inside the model.
    """
    compiled = None
    while True:
        if is_compiled_module(model):
            compiled = model
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
    if keep_torch_compile and compiled is not None:
        return compiled
    return model
