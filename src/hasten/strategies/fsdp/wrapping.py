"""Which submodules get their own ``fully_shard``, and which parameters FSDP leaves alone, as the plugin says."""

from __future__ import annotations

import re

import torch

from ...errors import ConfigError
from .plugin import FullyShardedDataParallelPlugin


def wrap_targets(plugin: FullyShardedDataParallelPlugin, model: torch.nn.Module) -> list[torch.nn.Module]:
    """The submodules of ``model`` that get their own ``fully_shard`` (children listed before their parents; the root
    excluded)."""
    plugin.set_auto_wrap_policy(model)
    policy = plugin.auto_wrap_policy
    if policy == "NO_WRAP":
        return []
    if policy == "TRANSFORMER_BASED_WRAP":
        names = set(plugin.transformer_cls_names_to_wrap)
        return [m for m in _post_order(model) if m is not model and type(m).__name__ in names]
    if policy == "SIZE_BASED_WRAP":
        return _size_based(model, plugin.min_num_params)
    return [m for m in _post_order(model) if m is not model and policy(m)]


def ignored_parameters(plugin: FullyShardedDataParallelPlugin, model: torch.nn.Module) -> set[torch.nn.Parameter]:
    """The parameters of the plugin's ``ignored_modules`` (modules, or a regular expression over module names)."""
    ignored = plugin.ignored_modules
    if not ignored:
        return set()
    if isinstance(ignored, str):
        pattern = re.compile(ignored)
        modules = [m for name, m in model.named_modules() if name and pattern.fullmatch(name)]
        if not modules:
            raise ConfigError(
                f"FullyShardedDataParallelPlugin: ignored_modules={ignored!r} matches no module name of this model "
                "(matched with re.fullmatch)."
            )
    else:
        modules = list(ignored)
    return {p for m in modules for p in m.parameters()}


def _post_order(module: torch.nn.Module) -> list[torch.nn.Module]:
    order: list[torch.nn.Module] = []
    for child in module.children():
        order.extend(_post_order(child))
    order.append(module)
    return order


def _size_based(model: torch.nn.Module, min_num_params: int) -> list[torch.nn.Module]:
    """Modules (children first) whose parameters not yet covered by a wrapped descendant reach ``min_num_params``."""
    targets: list[torch.nn.Module] = []
    covered: set[int] = set()
    for module in _post_order(model):
        if module is model:
            continue
        own = [p for p in module.parameters() if id(p) not in covered]
        if sum(p.numel() for p in own) >= min_num_params:
            targets.append(module)
            covered.update(id(p) for p in own)
    return targets
