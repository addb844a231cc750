"""Small FSDP helpers of Accelerate's API (``accelerate.utils.fsdp_utils``) that libraries call directly.

trl builds FSDP ignore lists with :func:`get_parameters_from_modules`; transformers switches its
low-RAM loading with the ``FSDP_CPU_RAM_EFFICIENT_LOADING`` variable that the ``*_ram_efficient_loading``
helpers set for it.
"""

from __future__ import annotations

import os
import re
from typing import Iterable

import torch

from .. import environment
from ..settings import ACCELERATE_PREFIX


def enable_fsdp_ram_efficient_loading() -> None:
    """Tell transformers to load pretrained weights on rank 0 only (FSDP broadcasts them), saving host RAM.

    Sets ``FSDP_CPU_RAM_EFFICIENT_LOADING=True`` and, when unset, ``ACCELERATE_USE_FSDP=True`` (the variable
    transformers' ``is_fsdp_enabled`` reads) in this process's environment.
    """
    os.environ.setdefault(environment.variable_name("USE_FSDP", ACCELERATE_PREFIX), "True")
    os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "True"


def disable_fsdp_ram_efficient_loading() -> None:
    """Undo :func:`enable_fsdp_ram_efficient_loading`: every rank loads the pretrained weights itself."""
    os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "False"


def fsdp2_canonicalize_names(named_params: dict) -> dict:
    """``named_params`` with the name parts that activation checkpointing and ``torch.compile`` add removed.

    ``layer._checkpoint_wrapped_module.weight`` and ``_orig_mod.layer.weight`` both become ``layer.weight``.
    """
    canonical = {}
    for name, value in named_params.items():
        name = name.replace("._checkpoint_wrapped_module", "")
        if name.startswith("_orig_mod."):
            name = name[len("_orig_mod.") :]
        canonical[name.replace("._orig_mod", "")] = value
    return canonical


def get_parameters_from_modules(
    modules: Iterable[torch.nn.Module] | str | None, model, device
) -> set[torch.nn.Parameter]:
    """The parameters of ``modules``: an iterable of modules, or a regular expression matched against the full
    names of ``model``'s submodules (matched modules are moved to ``device`` first, as FSDP's ignored modules must be).
    ``None`` gives an empty set.
    """
    if modules is None:
        return set()
    if isinstance(modules, str):
        pattern = re.compile(modules)
        modules = [module.to(device) for name, module in model.named_modules() if pattern.fullmatch(name)]
    return {parameter for module in modules for parameter in module.parameters()}


def get_fsdp2_grad_scaler(**kwargs) -> torch.amp.GradScaler:
    """A ``torch.amp.GradScaler`` built with ``kwargs`` (FSDP2 shards are DTensors, which the plain scaler handles)."""
    return torch.amp.GradScaler(**kwargs)
