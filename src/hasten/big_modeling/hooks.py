"""Hooks around a module's ``forward``: move inputs to its device, bring offloaded weights in and out.

:func:`add_hook_to_module` replaces ``module.forward`` by a wrapper that calls the hook's
``pre_forward`` (which may change the arguments), the original forward, then ``post_forward`` (which
may change the output). The hook is stored as ``module._hf_hook`` and the original forward as
``module._old_forward``, the attribute names the Hugging Face libraries look for.
:func:`remove_hook_from_module` puts everything back.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping

import torch
from torch import nn

from ..errors import CheckpointError
from ..runtime.tree import find_device, send_to_device
from ..runtime.weights.offloaded import OffloadingHook
from .tensors import get_module_tensor, get_non_persistent_buffers, named_module_tensors, set_module_tensor_to_device


class ModelHook:
    """A hook run around a module's forward. Subclass it and override what you need.

    Attributes:
        no_grad: run the module's forward under ``torch.no_grad()``.
    """

    no_grad = False

    def init_hook(self, module: nn.Module) -> nn.Module:
        """Called when the hook is attached; returns the module (possibly changed)."""
        return module

    def pre_forward(self, module: nn.Module, *args, **kwargs):
        """Called before the forward with its arguments; returns ``(args, kwargs)`` to call it with."""
        return args, kwargs

    def post_forward(self, module: nn.Module, output):
        """Called after the forward with its output; returns the output to give the caller."""
        return output

    def detach_hook(self, module: nn.Module) -> nn.Module:
        """Called when the hook is removed; undoes what :meth:`init_hook` did."""
        return module


SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING = (
    nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d, nn.Linear,
)  # fmt: skip
"""The layers whose weights ``attach_layerwise_casting_hooks`` stores in a low dtype (Accelerate's constant)."""


class LayerwiseCastingHook(ModelHook):
    """Keep a layer's weights in ``storage_dtype`` (e.g. ``torch.float8_e4m3fn``) and cast them to ``compute_dtype``
    only for its forward, saving memory at some cost in precision (see ``attach_layerwise_casting_hooks``)."""

    def __init__(self, storage_dtype: torch.dtype, compute_dtype: torch.dtype, non_blocking: bool) -> None:
        self.storage_dtype = storage_dtype
        self.compute_dtype = compute_dtype
        self.non_blocking = non_blocking

    def init_hook(self, module: nn.Module) -> nn.Module:
        return module.to(dtype=self.storage_dtype, non_blocking=self.non_blocking)

    def pre_forward(self, module: nn.Module, *args, **kwargs):
        module.to(dtype=self.compute_dtype, non_blocking=self.non_blocking)
        return args, kwargs

    def post_forward(self, module: nn.Module, output):
        module.to(dtype=self.storage_dtype, non_blocking=self.non_blocking)
        return output


class SequentialHook(ModelHook):
    """Several hooks run one after the other (``pre_forward`` in order, ``post_forward`` in order too)."""

    def __init__(self, *hooks: ModelHook):
        self.hooks = hooks

    def init_hook(self, module):
        for hook in self.hooks:
            module = hook.init_hook(module)
        return module

    def pre_forward(self, module, *args, **kwargs):
        for hook in self.hooks:
            args, kwargs = hook.pre_forward(module, *args, **kwargs)
        return args, kwargs

    def post_forward(self, module, output):
        for hook in self.hooks:
            output = hook.post_forward(module, output)
        return output

    def detach_hook(self, module):
        for hook in self.hooks:
            module = hook.detach_hook(module)
        return module


def _hooked_forward(module: nn.Module, *args, **kwargs):
    hook = module._hf_hook
    args, kwargs = hook.pre_forward(module, *args, **kwargs)
    if hook.no_grad:
        with torch.no_grad():
            output = module._old_forward(*args, **kwargs)
    else:
        output = module._old_forward(*args, **kwargs)
    return hook.post_forward(module, output)


def _is_graph_module(module: nn.Module) -> bool:
    return "GraphModuleImpl" in str(type(module))


# methods dispatch_model wraps on a model (Accelerate's names), dropped again by remove_hook_from_module
_ADDED_METHODS = ("to", "cuda", "npu", "xpu", "mlu", "sdaa", "musa")


def add_hook_to_module(module: nn.Module, hook: ModelHook, append: bool = False) -> nn.Module:
    """Attach ``hook`` to ``module``: its forward now runs ``hook.pre_forward`` and ``hook.post_forward``.

    Args:
        module: the module.
        hook: the hook (its ``init_hook`` runs now).
        append: keep a hook already there and run ``hook`` after it (the old hook is detached and both are
            attached again as a :class:`SequentialHook`). Otherwise a hook already there is replaced without
            being detached (its ``detach_hook`` does not run), as in Accelerate.

    Returns:
        The module (as returned by ``hook.init_hook``).
    """
    if append and getattr(module, "_hf_hook", None) is not None:
        previous = module._hf_hook
        remove_hook_from_module(module)
        hook = SequentialHook(previous, hook)
    if hasattr(module, "_hf_hook") and hasattr(module, "_old_forward"):
        original = module._old_forward
    else:
        original = module.forward
        module._old_forward = original
    module = hook.init_hook(module)
    module._hf_hook = hook
    forward = functools.update_wrapper(functools.partial(_hooked_forward, module), original)
    if _is_graph_module(module):
        module.__class__.forward = forward
    else:
        module.forward = forward
    return module


def remove_hook_from_module(module: nn.Module, recurse: bool = False) -> nn.Module:
    """Remove the hook of ``module`` (calling its ``detach_hook``) and put back the forward it replaced.

    The original forward is set back as an attribute of the module, and the device-moving methods that
    :func:`hasten.dispatch_model` wrapped are dropped, as in Accelerate.

    Args:
        module: the module.
        recurse: do the same for every submodule.
    """
    if hasattr(module, "_hf_hook"):
        module._hf_hook.detach_hook(module)
        delattr(module, "_hf_hook")
    if hasattr(module, "_old_forward"):
        if _is_graph_module(module):
            module.__class__.forward = module._old_forward
        else:
            module.forward = module._old_forward
        delattr(module, "_old_forward")
    for name in _ADDED_METHODS:
        module.__dict__.pop(name, None)
    if recurse:
        for child in module.children():
            remove_hook_from_module(child, recurse)
    return module


class MissingOffloadedWeightError(CheckpointError, KeyError):
    """An offloaded weight that the hook's weights map does not hold."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class AlignDevicesHook(ModelHook, OffloadingHook):
    """Runs a module on ``execution_device``: moves its inputs there and, when offloaded, its weights too.

    As an :class:`~hasten.runtime.weights.offloaded.OffloadingHook` it lets code that saves a model (which knows
    nothing of big-model inference) read the offloaded weights.

    Args:
        execution_device: where the forward runs (None: inputs and weights stay where they are).
        offload: keep the weights on the meta device between forwards and load them from ``weights_map`` for each
            forward.
        io_same_device: give the output back on the device the inputs came from.
        weights_map: name -> tensor for the offloaded weights (a dict, an
            :class:`~hasten.big_modeling.offload.OffloadedWeightsLoader`, ...); a CPU copy of the module's own
            weights when None.
        offload_buffers: offload the buffers too (they go to ``execution_device`` otherwise).
        place_submodules: handle the submodules' tensors too (for a module used as one block).
        skip_keys: keys of mapping inputs/outputs that are not moved.
        tied_params_map: ``{data_ptr: {device: tensor}}`` so that a tied weight is brought to the
            execution device once per forward.
    """

    def __init__(
        self,
        execution_device=None,
        offload: bool = False,
        io_same_device: bool = False,
        weights_map: Mapping | None = None,
        offload_buffers: bool = False,
        place_submodules: bool = False,
        skip_keys: str | list[str] | None = None,
        tied_params_map: dict | None = None,
    ):
        self.execution_device = execution_device
        self.offload = offload
        self.io_same_device = io_same_device
        self.weights_map = weights_map
        self.offload_buffers = offload_buffers
        self.place_submodules = place_submodules
        self.skip_keys = skip_keys
        self.input_device = None
        self.param_original_devices: dict = {}
        self.buffer_original_devices: dict = {}
        self.tied_params_names: set = set()
        self.tied_params_map = tied_params_map
        self.tied_pointers_to_remove: set = set()

    def __repr__(self) -> str:
        return (
            f"AlignDevicesHook(execution_device={self.execution_device}, offload={self.offload}, "
            f"io_same_device={self.io_same_device}, offload_buffers={self.offload_buffers}, "
            f"place_submodules={self.place_submodules}, skip_keys={self.skip_keys!r})"
        )

    def _offloaded(self, module: nn.Module) -> list[str]:
        """The names of the tensors brought in for each forward (non-persistent buffers stay in place)."""
        tensors = named_module_tensors(
            module, include_buffers=self.offload_buffers, recurse=self.place_submodules, remove_non_persistent=True
        )
        return [name for name, _ in tensors]

    def _offload_weights(self, module: nn.Module) -> None:
        self.original_devices = {
            name: tensor.device for name, tensor in named_module_tensors(module, recurse=self.place_submodules)
        }
        if self.weights_map is None:
            tensors = named_module_tensors(module, include_buffers=self.offload_buffers, recurse=self.place_submodules)
            self.weights_map = {name: tensor.to("cpu") for name, tensor in tensors}
        for name in self._offloaded(module):
            if self.tied_params_map is not None and get_module_tensor(module, name).data_ptr() in self.tied_params_map:
                self.tied_params_names.add(name)
            set_module_tensor_to_device(module, name, "meta")
        if self.execution_device is None:
            return
        if self.offload_buffers:
            staying = get_non_persistent_buffers(module, recurse=self.place_submodules)
        else:
            staying = [name for name, _ in module.named_buffers(recurse=self.place_submodules)]
        for name in staying:
            set_module_tensor_to_device(module, name, self.execution_device, tied_params_map=self.tied_params_map)

    def init_hook(self, module):
        if self.execution_device in ("meta", torch.device("meta")):
            self.tied_params_map = None
        if not self.offload and self.execution_device is not None:
            for name, _ in named_module_tensors(module, recurse=self.place_submodules):
                set_module_tensor_to_device(module, name, self.execution_device, tied_params_map=self.tied_params_map)
        elif self.offload:
            self._offload_weights(module)
        return module

    def _weight(self, module: nn.Module, name: str) -> torch.Tensor:
        try:
            return self.weights_map[name]
        except KeyError:
            raise MissingOffloadedWeightError(
                f"The offloaded weight {name!r} of {type(module).__name__} is not in its weights map; the offload "
                "folder or state dict given to dispatch_model does not hold it."
            ) from None

    def _bring_in(self, module: nn.Module) -> None:
        self.tied_pointers_to_remove = set()
        for name in self._offloaded(module):
            value = self._weight(module, name)
            pointer = value.data_ptr()
            if name in self.tied_params_names and pointer not in self.tied_params_map:
                self.tied_params_map[pointer] = {}
            if (
                self.tied_params_map is not None
                and pointer in self.tied_params_map
                and self.execution_device not in self.tied_params_map[pointer]
            ):
                self.tied_pointers_to_remove.add((pointer, self.execution_device))
            set_module_tensor_to_device(
                module, name, self.execution_device, value=value, tied_params_map=self.tied_params_map
            )

    def pre_forward(self, module, *args, **kwargs):
        if self.io_same_device:
            self.input_device = find_device([args, kwargs])
        if self.offload:
            self._bring_in(module)
        return send_to_device(args, self.execution_device), send_to_device(
            kwargs, self.execution_device, skip_keys=self.skip_keys
        )

    def post_forward(self, module, output):
        if self.offload:
            for name in self._offloaded(module):
                set_module_tensor_to_device(module, name, "meta")
            for pointer, device in self.tied_pointers_to_remove:
                self.tied_params_map[pointer].pop(device, None)
            self.tied_pointers_to_remove = set()
        if self.io_same_device and self.input_device is not None:
            output = send_to_device(output, self.input_device, skip_keys=self.skip_keys)
        return output

    @property
    def offloads_weights(self) -> bool:
        """True when the weights are kept off the module between forwards (``offload``)."""
        return bool(self.offload)

    @contextlib.contextmanager
    def weights_on(self, module: nn.Module, device=None):
        """Inside this context the offloaded weights of ``module`` are real tensors on ``device`` (None: the
        execution device); they go back out on exit, even when the body raises."""
        original = self.execution_device
        if device is not None:
            self.execution_device = device
        try:
            self.pre_forward(module)
            yield
        finally:
            self.post_forward(module, None)
            if device is not None:
                self.execution_device = original

    def detach_hook(self, module):
        if self.offload:
            for name, device in self.original_devices.items():
                if device != torch.device("meta"):
                    set_module_tensor_to_device(module, name, device, value=self.weights_map.get(name, None))
        return module


class CpuOffload(ModelHook):
    """Keeps a whole model on the CPU and moves it to ``execution_device`` when its forward is called.

    The model stays on the execution device after the forward, until ``prev_module_hook.offload()``
    of the next model in a pipeline (or :meth:`UserCpuOffloadHook.offload`) sends it back.

    Args:
        execution_device: where the forward runs (the process's default device when None).
        prev_module_hook: the hook of the model that runs before this one; it is offloaded when
            this model's forward starts (if it is not on the CPU already).
    """

    def __init__(self, execution_device=None, prev_module_hook: UserCpuOffloadHook | None = None):
        self.prev_module_hook = prev_module_hook
        if execution_device is None:
            from ..state import PartialState

            execution_device = PartialState().default_device
        self.execution_device = execution_device

    def init_hook(self, module):
        return module.to("cpu")

    def pre_forward(self, module, *args, **kwargs):
        if isinstance(self.prev_module_hook, UserCpuOffloadHook):
            if next(self.prev_module_hook.model.parameters()).device != torch.device("cpu"):
                self.prev_module_hook.offload()
                _empty_cache()
        if next(module.parameters()).device == self.execution_device:
            return args, kwargs
        module.to(self.execution_device)
        return send_to_device(args, self.execution_device), send_to_device(kwargs, self.execution_device)


def _empty_cache() -> None:
    from ..runtime.memory import clear_device_cache

    clear_device_cache()


class UserCpuOffloadHook:
    """The handle :func:`hasten.cpu_offload_with_hook` returns: send the model back to the CPU, or unhook it."""

    def __init__(self, model: nn.Module, hook: CpuOffload):
        self.model = model
        self.hook = hook

    def offload(self) -> None:
        """Move the model back to the CPU."""
        self.hook.init_hook(self.model)

    def remove(self) -> None:
        """Remove the hook; the model stays where it is."""
        remove_hook_from_module(self.model)


def has_offloaded_params(module: nn.Module) -> bool:
    """True when ``module`` has an :class:`AlignDevicesHook` that offloads its weights."""
    hook = getattr(module, "_hf_hook", None)
    return isinstance(hook, AlignDevicesHook) and bool(hook.offload)


@contextlib.contextmanager
def align_module_device(module: nn.Module, execution_device=None):
    """Inside this context the weights of ``module`` are real tensors on one device.

    For an offloaded module the weights are brought in (to ``execution_device`` or the hook's own
    device) and sent back out on exit; otherwise, with ``execution_device``, the module's own
    parameters are moved there and back.
    """
    if has_offloaded_params(module):
        with module._hf_hook.weights_on(module, execution_device):
            yield
    elif execution_device is not None:
        devices = {name: param.device for name, param in module.named_parameters(recurse=False)}
        try:
            for name in devices:
                set_module_tensor_to_device(module, name, execution_device)
            yield
        finally:
            for name, device in devices.items():
                set_module_tensor_to_device(module, name, device)
    else:
        yield
