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

from ..errors import CheckpointError, ConfigError
from .modeling import as_device, get_non_persistent_buffers, named_module_tensors, set_module_tensor_to_device
from .offload import PrefixedDataset
from ..runtime.tree import find_device, send_to_device


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
    return "GraphModuleImpl" in type(module).__name__


def add_hook_to_module(module: nn.Module, hook: ModelHook, append: bool = False) -> nn.Module:
    """Attach ``hook`` to ``module``: its forward now runs ``hook.pre_forward`` and ``hook.post_forward``.

    Args:
        module: the module.
        hook: the hook (its ``init_hook`` runs now).
        append: keep a hook already there and run ``hook`` after it (a :class:`SequentialHook`);
            otherwise an existing hook is removed first.

    Returns:
        The module (as returned by ``hook.init_hook``).
    """
    previous = getattr(module, "_hf_hook", None)
    if previous is not None:
        remove_hook_from_module(module)
        if append:
            hook = SequentialHook(previous, hook)
    original = module.forward
    module = hook.init_hook(module)
    module._hf_hook = hook
    module._old_forward = original
    forward = functools.update_wrapper(functools.partial(_hooked_forward, module), original)
    if _is_graph_module(module):
        module.__class__.forward = forward
    else:
        module.forward = forward
    return module


def remove_hook_from_module(module: nn.Module, recurse: bool = False) -> nn.Module:
    """Remove the hook of ``module`` (calling its ``detach_hook``) and restore the original forward.

    Args:
        module: the module.
        recurse: do the same for every submodule.
    """
    hook = module.__dict__.pop("_hf_hook", None)
    if hook is not None:
        hook.detach_hook(module)
    original = module.__dict__.pop("_old_forward", None)
    if original is not None:
        if _is_graph_module(module):
            module.__class__.forward = original
        elif getattr(original, "__func__", None) is type(module).forward and getattr(original, "__self__", None) is module:
            module.__dict__.pop("forward", None)
        else:
            module.forward = original
    for name in module.__dict__.pop("_hasten_guarded_methods", ()):
        module.__dict__.pop(name, None)
    if recurse:
        for child in module.children():
            remove_hook_from_module(child, recurse=True)
    return module


def remove_hook_from_submodules(module: nn.Module) -> None:
    """Remove the hooks of every submodule of ``module`` (not of ``module`` itself)."""
    for child in module.children():
        remove_hook_from_module(child)
        remove_hook_from_submodules(child)


class AlignDevicesHook(ModelHook):
    """Runs a module on ``execution_device``: moves its inputs there and, when offloaded, its weights too.

    Args:
        execution_device: where the forward runs (None: leave inputs and weights where they are).
        offload: keep the weights on the meta device between forwards and load them from
            ``weights_map`` for each forward.
        io_same_device: give the output back on the device the inputs came from.
        weights_map: name -> tensor for the offloaded weights (a dict, an
            :class:`~hasten.big_modeling.offload.OffloadedWeightsLoader`, ...); the module's own weights when None.
        offload_buffers: offload the buffers too (they stay on ``execution_device`` otherwise).
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
        if offload and execution_device is None:
            raise ConfigError("AlignDevicesHook(offload=True) needs an execution_device to bring the weights to.")
        self.execution_device = execution_device
        self.offload = offload
        self.io_same_device = io_same_device
        self.weights_map = weights_map
        self.offload_buffers = offload_buffers
        self.place_submodules = place_submodules
        self.skip_keys = skip_keys
        self.tied_params_map = tied_params_map
        self.input_device = None
        self.original_devices: dict = {}
        self._tied_added: set = set()

    def __repr__(self) -> str:
        return (
            f"AlignDevicesHook(execution_device={self.execution_device}, offload={self.offload}, "
            f"io_same_device={self.io_same_device}, offload_buffers={self.offload_buffers}, "
            f"place_submodules={self.place_submodules}, skip_keys={self.skip_keys!r})"
        )

    def _offloaded_tensors(self, module: nn.Module):
        return named_module_tensors(module, include_buffers=self.offload_buffers, recurse=self.place_submodules, remove_non_persistent=True)

    def init_hook(self, module):
        if str(self.execution_device) == "meta":
            self.tied_params_map = None
        if not self.offload:
            if self.execution_device is not None:
                for name, _ in list(named_module_tensors(module, recurse=self.place_submodules)):
                    set_module_tensor_to_device(module, name, self.execution_device, tied_params_map=self.tied_params_map, clear_cache=False)
            return module
        self.original_devices = {name: tensor.device for name, tensor in named_module_tensors(module, recurse=self.place_submodules)}
        if self.weights_map is None:
            self.weights_map = {name: tensor.to("cpu") for name, tensor in self._offloaded_tensors(module)}
        for name, _ in list(self._offloaded_tensors(module)):
            set_module_tensor_to_device(module, name, "meta", clear_cache=False)
        if self.execution_device is not None:
            if self.offload_buffers:
                stay = get_non_persistent_buffers(module, recurse=self.place_submodules, fqns=True)
            else:
                stay = [name for name, _ in module.named_buffers(recurse=self.place_submodules)]
            for name in stay:
                set_module_tensor_to_device(module, name, self.execution_device, clear_cache=False)
        return module

    def _load(self, module: nn.Module, name: str) -> None:
        try:
            value = self.weights_map[name]
        except KeyError:
            raise CheckpointError(
                f"The offloaded weight {name!r} of {type(module).__name__} is not in its weights map; the offload "
                "folder or state dict given to dispatch_model does not hold it."
            ) from None
        if self.tied_params_map is not None:
            key, device = value.data_ptr(), as_device(self.execution_device)
            if key in self.tied_params_map and device not in self.tied_params_map[key]:
                self._tied_added.add((key, device))
        set_module_tensor_to_device(module, name, self.execution_device, value=value, tied_params_map=self.tied_params_map, clear_cache=False)

    def pre_forward(self, module, *args, **kwargs):
        if self.io_same_device:
            self.input_device = find_device([args, kwargs])
        if self.offload:
            for name, _ in list(self._offloaded_tensors(module)):
                self._load(module, name)
        if self.execution_device is None:
            return args, kwargs
        return send_to_device(args, self.execution_device), send_to_device(kwargs, self.execution_device, skip_keys=self.skip_keys)

    def post_forward(self, module, output):
        if self.offload:
            for name, _ in list(self._offloaded_tensors(module)):
                set_module_tensor_to_device(module, name, "meta", clear_cache=False)
            for key, device in self._tied_added:
                self.tied_params_map[key].pop(device, None)
            self._tied_added = set()
        if self.io_same_device and self.input_device is not None:
            output = send_to_device(output, self.input_device, skip_keys=self.skip_keys)
        return output

    def detach_hook(self, module):
        if self.offload:
            for name, device in self.original_devices.items():
                if device.type != "meta":
                    set_module_tensor_to_device(module, name, device, value=self.weights_map.get(name), clear_cache=False)
        return module


class CpuOffload(ModelHook):
    """Keeps a whole model on the CPU and moves it to ``execution_device`` when its forward is called.

    The model stays on the execution device after the forward, until ``prev_module_hook.offload()``
    of the next model in a pipeline (or :meth:`UserCpuOffloadHook.offload`) sends it back.

    Args:
        execution_device: where the forward runs (the process's default device when None).
        prev_module_hook: the hook of the model that runs before this one; it is offloaded when
            this model's forward starts.
    """

    def __init__(self, execution_device=None, prev_module_hook: UserCpuOffloadHook | None = None):
        if execution_device is None:
            from ..state import PartialState

            execution_device = PartialState().default_device
        self.execution_device = execution_device
        self.prev_module_hook = prev_module_hook

    def init_hook(self, module):
        return module.to("cpu")

    def pre_forward(self, module, *args, **kwargs):
        if self.prev_module_hook is not None:
            self.prev_module_hook.offload()
        module.to(self.execution_device)
        return send_to_device(args, self.execution_device), send_to_device(kwargs, self.execution_device)


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


def _has_tensors(module: nn.Module) -> bool:
    return next(named_module_tensors(module, recurse=False), None) is not None


def attach_execution_device_hook(
    module: nn.Module,
    execution_device,
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    tied_params_map: dict | None = None,
) -> None:
    """Give every submodule holding tensors (and without a hook) a hook moving its inputs to ``execution_device``.

    Modules whose class is in ``preload_module_classes`` are not descended into.
    """
    if not hasattr(module, "_hf_hook") and _has_tensors(module):
        add_hook_to_module(module, AlignDevicesHook(execution_device, skip_keys=skip_keys, tied_params_map=tied_params_map))
    if preload_module_classes is not None and type(module).__name__ in preload_module_classes:
        return
    for child in module.children():
        attach_execution_device_hook(child, execution_device, skip_keys, preload_module_classes, tied_params_map)


def _prefixed(weights_map: Mapping | None, module_name: str) -> Mapping | None:
    if weights_map is None or not module_name:
        return weights_map
    return PrefixedDataset(weights_map, f"{module_name}.")


def attach_align_device_hook(
    module: nn.Module,
    execution_device=None,
    offload: bool = False,
    weights_map: Mapping | None = None,
    offload_buffers: bool = False,
    module_name: str = "",
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    tied_params_map: dict | None = None,
) -> None:
    """Attach an :class:`AlignDevicesHook` to ``module`` and each submodule that holds tensors.

    A module whose class is in ``preload_module_classes`` gets one hook that loads the weights of all
    its submodules at once (for modules that use a submodule's weights without calling it).

    Args:
        module: the module.
        execution_device: where the forwards run.
        offload: offload the weights (see :class:`AlignDevicesHook`).
        weights_map: name -> tensor for the whole of ``module`` (names relative to ``module_name``'s parent).
        offload_buffers: offload buffers too.
        module_name: the name of ``module`` in ``weights_map``.
        skip_keys: keys of mapping inputs that are not moved.
        preload_module_classes: class names loaded as one block.
        tied_params_map: see :class:`AlignDevicesHook`.
    """
    whole = offload and preload_module_classes is not None and type(module).__name__ in preload_module_classes
    if _has_tensors(module) or whole:
        hook = AlignDevicesHook(
            execution_device,
            offload=offload,
            weights_map=_prefixed(weights_map, module_name),
            offload_buffers=offload_buffers,
            place_submodules=whole,
            skip_keys=skip_keys,
            tied_params_map=tied_params_map,
        )
        add_hook_to_module(module, hook, append=True)
    if whole:
        return
    for child_name, child in module.named_children():
        child_full = f"{module_name}.{child_name}" if module_name else child_name
        attach_align_device_hook(
            child, execution_device, offload, weights_map, offload_buffers, child_full, skip_keys, preload_module_classes, tied_params_map
        )


def _direct_entries(module: nn.Module, module_name: str, table: Mapping) -> list[str]:
    prefix = f"{module_name}." if module_name else ""
    return [f"{prefix}{name}" for name, _ in named_module_tensors(module) if f"{prefix}{name}" in table]


def attach_align_device_hook_on_blocks(
    module: nn.Module,
    execution_device=None,
    offload=False,
    weights_map: Mapping | None = None,
    offload_buffers: bool = False,
    module_name: str = "",
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    tied_params_map: dict | None = None,
) -> None:
    """Attach hooks block by block, following a device map.

    Args:
        module: the model (or a block of it).
        execution_device: ``{block_name: device}`` (or one device for everything).
        offload: ``{block_name: bool}`` (or one bool): whether each block's weights are offloaded.
        weights_map: name -> tensor for the offloaded weights.
        offload_buffers: offload buffers too.
        module_name: the name of ``module`` in the maps.
        skip_keys: keys of mapping inputs that are not moved.
        preload_module_classes: class names loaded as one block.
        tied_params_map: see :class:`AlignDevicesHook`.
    """
    if not isinstance(execution_device, Mapping) and not isinstance(offload, Mapping):
        if offload:
            attach_align_device_hook(
                module, execution_device, True, weights_map, offload_buffers, module_name, skip_keys, preload_module_classes, tied_params_map
            )
        else:
            hook = AlignDevicesHook(execution_device, io_same_device=True, skip_keys=skip_keys, place_submodules=True, tied_params_map=tied_params_map)
            add_hook_to_module(module, hook)
        return
    if not isinstance(execution_device, Mapping):
        execution_device = dict.fromkeys(offload, execution_device)
    if not isinstance(offload, Mapping):
        offload = dict.fromkeys(execution_device, bool(offload))
    options = {"skip_keys": skip_keys, "tied_params_map": tied_params_map}
    if module_name in execution_device and module_name in offload and not offload[module_name]:
        device = execution_device[module_name]
        hook = AlignDevicesHook(device, io_same_device=module_name == "", place_submodules=True, offload_buffers=offload_buffers, **options)
        add_hook_to_module(module, hook)
        attach_execution_device_hook(module, device, skip_keys, preload_module_classes, tied_params_map)
        return
    if module_name in execution_device and module_name in offload:
        device = execution_device[module_name]
        attach_align_device_hook(module, device, True, weights_map, offload_buffers, module_name, skip_keys, preload_module_classes, tied_params_map)
        if not hasattr(module, "_hf_hook"):
            add_hook_to_module(module, AlignDevicesHook(device, io_same_device=module_name == "", **options))
        return
    direct = _direct_entries(module, module_name, execution_device)
    if direct:
        block_offload = any(offload.get(name, False) for name in direct)
        device = execution_device[direct[0]]
        hook = AlignDevicesHook(
            device,
            offload=block_offload,
            io_same_device=module_name == "",
            weights_map=_prefixed(weights_map, module_name) if block_offload else None,
            offload_buffers=offload_buffers,
            **options,
        )
        add_hook_to_module(module, hook)
    elif module_name == "":
        add_hook_to_module(module, AlignDevicesHook(execution_device.get(""), io_same_device=True, **options))
    for child_name, child in module.named_children():
        child_full = f"{module_name}.{child_name}" if module_name else child_name
        attach_align_device_hook_on_blocks(
            child, execution_device, offload, weights_map, offload_buffers, child_full, skip_keys, preload_module_classes, tied_params_map
        )


def has_offloaded_params(module: nn.Module) -> bool:
    """True when ``module`` has an :class:`AlignDevicesHook` that offloads its weights."""
    hook = getattr(module, "_hf_hook", None)
    return isinstance(hook, AlignDevicesHook) and hook.offload


@contextlib.contextmanager
def align_module_device(module: nn.Module, execution_device=None):
    """Inside this context the weights of ``module`` are real tensors on one device.

    For an offloaded module the weights are brought in (to ``execution_device`` or the hook's own
    device) and sent back out on exit; otherwise, with ``execution_device``, the module's own
    parameters are moved there and back.
    """
    if has_offloaded_params(module):
        hook = module._hf_hook
        original = hook.execution_device
        if execution_device is not None:
            hook.execution_device = execution_device
        try:
            hook.pre_forward(module)
            yield
        finally:
            hook.post_forward(module, None)
            hook.execution_device = original
    elif execution_device is not None:
        devices = {name: param.device for name, param in module.named_parameters(recurse=False)}
        try:
            for name in devices:
                set_module_tensor_to_device(module, name, execution_device, clear_cache=False)
            yield
        finally:
            for name, device in devices.items():
                set_module_tensor_to_device(module, name, device, clear_cache=False)
    else:
        yield
