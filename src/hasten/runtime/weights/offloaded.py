"""The state dict of a model whose weights may be offloaded: held off the module between forwards.

Big-model inference keeps some modules' weights on the CPU or on disk, and a forward hook brings them in for each
forward; between forwards the module holds placeholders on the meta device, so ``model.state_dict()`` would return
those. Whoever saves such a model (an engine's ``get_state_dict``, ``Accelerator.save_model``) reads it through
:func:`cpu_state_dict`, which asks each module's hook for its weights.

The hook is known by the interface below, which the hooks of :mod:`hasten.big_modeling.hooks` implement, so that
saving needs nothing of big-model inference: a module is offloaded when its ``_hf_hook`` (the attribute the Hugging
Face libraries use) is an :class:`OffloadingHook` that says it offloads.
"""

from __future__ import annotations

import abc
import contextlib

import torch
from torch import nn

_CPU = torch.device("cpu")


class OffloadingHook(abc.ABC):
    """A forward hook that may keep its module's weights elsewhere between forwards."""

    @property
    @abc.abstractmethod
    def offloads_weights(self) -> bool:
        """True when the module's weights are held off the module between forwards."""

    @abc.abstractmethod
    def weights_on(self, module: nn.Module, device) -> contextlib.AbstractContextManager:
        """A context inside which ``module``'s offloaded weights are real tensors on ``device``."""


def offloading_hook(module: nn.Module) -> OffloadingHook | None:
    """The hook that offloads ``module``'s weights, or None."""
    hook = getattr(module, "_hf_hook", None)
    return hook if isinstance(hook, OffloadingHook) and hook.offloads_weights else None


def has_offloaded_weights(model: nn.Module) -> bool:
    """True when some module of ``model`` has its weights offloaded."""
    return any(offloading_hook(module) is not None for module in model.modules())


def _own_tensors(module: nn.Module):
    yield from module.named_parameters(recurse=False)
    skip = module._non_persistent_buffers_set
    yield from ((name, buffer) for name, buffer in module.named_buffers(recurse=False) if name not in skip)


def cpu_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict of a model whose weights may be offloaded: parameters on the CPU.

    Offloaded weights are brought in module by module (disk weights stay memory-mapped); the other modules'
    parameters are copied to the CPU, their persistent buffers are taken as they are.
    """
    state: dict[str, torch.Tensor] = {}
    for prefix, module in model.named_modules():
        if next(_own_tensors(module), None) is None:
            continue
        hook = offloading_hook(module)
        context = hook.weights_on(module, _CPU) if hook is not None else contextlib.nullcontext()
        with context:
            for name, tensor in _own_tensors(module):
                if hook is None and isinstance(tensor, nn.Parameter):
                    tensor = tensor.to(_CPU)
                state[f"{prefix}.{name}" if prefix else name] = tensor.detach()
    return state
