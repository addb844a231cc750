"""Putting :class:`~hasten.big_modeling.hooks.AlignDevicesHook` on a whole model: on every module holding tensors,
or block by block following a device map. Which module gets which hook is Accelerate 1.15's choice, so that the
libraries that inspect ``module._hf_hook`` (diffusers, transformers, peft) find what they expect.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from .hooks import AlignDevicesHook, add_hook_to_module, remove_hook_from_module
from .offload import PrefixedDataset
from .tensors import named_module_tensors


def attach_execution_device_hook(
    module: nn.Module,
    execution_device,
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    tied_params_map: dict | None = None,
) -> None:
    """Give every submodule without a hook whose state dict is not empty a hook moving its inputs to
    ``execution_device``. Modules whose class is in ``preload_module_classes`` are not descended into."""
    if not hasattr(module, "_hf_hook") and len(module.state_dict()) > 0:
        add_hook_to_module(
            module, AlignDevicesHook(execution_device, skip_keys=skip_keys, tied_params_map=tied_params_map)
        )
    if preload_module_classes is not None and type(module).__name__ in preload_module_classes:
        return
    for child in module.children():
        attach_execution_device_hook(child, execution_device, skip_keys, preload_module_classes, tied_params_map)


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
    """Attach (appending) an :class:`AlignDevicesHook` to ``module`` and each submodule that holds tensors itself.

    A module whose class is in ``preload_module_classes`` gets, when offloading, one hook that loads the weights of
    all its submodules at once (for modules that use a submodule's weights without calling it).

    Args:
        module: the module.
        execution_device: where the forwards run.
        offload: offload the weights (see :class:`AlignDevicesHook`).
        weights_map: name -> tensor for the whole model; each hook sees it through the prefix ``module_name.``.
        offload_buffers: offload buffers too.
        module_name: the name of ``module`` in ``weights_map``.
        skip_keys: keys of mapping inputs that are not moved.
        preload_module_classes: class names loaded as one block.
        tied_params_map: see :class:`AlignDevicesHook`.
    """
    whole = offload and preload_module_classes is not None and type(module).__name__ in preload_module_classes
    if next(named_module_tensors(module), None) is not None or whole:
        prefixed = (
            None if weights_map is None else PrefixedDataset(weights_map, f"{module_name}." if module_name else "")
        )
        hook = AlignDevicesHook(
            execution_device,
            offload=offload,
            weights_map=prefixed,
            offload_buffers=offload_buffers,
            place_submodules=whole,
            skip_keys=skip_keys,
            tied_params_map=tied_params_map,
        )
        add_hook_to_module(module, hook, append=True)
    if whole:
        return
    for child_name, child in module.named_children():
        attach_align_device_hook(
            child,
            execution_device,
            offload,
            weights_map,
            offload_buffers,
            f"{module_name}.{child_name}" if module_name else child_name,
            skip_keys,
            preload_module_classes,
            tied_params_map,
        )


def remove_hook_from_submodules(module: nn.Module) -> None:
    """Remove the hooks of ``module`` and of every module under it."""
    remove_hook_from_module(module)
    for child in module.children():
        remove_hook_from_submodules(child)


def _uniform(
    module: nn.Module, execution_device, offload, weights_map, offload_buffers, module_name, skip_keys, tied_params_map
) -> None:
    """One device and one offload choice for the whole of ``module``."""
    if offload:
        attach_align_device_hook(
            module,
            execution_device,
            True,
            weights_map,
            offload_buffers,
            module_name,
            skip_keys,
            tied_params_map=tied_params_map,
        )
        return
    hook = AlignDevicesHook(
        execution_device,
        io_same_device=True,
        skip_keys=skip_keys,
        place_submodules=True,
        tied_params_map=tied_params_map,
    )
    add_hook_to_module(module, hook)


def _offloaded_tensor_entries(
    module, module_name, execution_device, offload, weights_map, offload_buffers, skip_keys, tied_params_map
) -> bool:
    """Hook a module whose own tensors have entries of their own in the maps, one of them offloaded (a device map
    split at tensor level): its weights are brought in for its forward. Accelerate attaches nothing there, which
    leaves those tensors on the meta device. Returns whether a hook was attached."""
    prefix = f"{module_name}." if module_name else ""
    entries = [prefix + name for name, _ in named_module_tensors(module) if prefix + name in offload]
    if not any(offload[name] for name in entries):
        return False
    hook = AlignDevicesHook(
        execution_device[entries[0]],
        offload=True,
        io_same_device=module_name == "",
        weights_map=PrefixedDataset(weights_map, prefix),
        offload_buffers=offload_buffers,
        skip_keys=skip_keys,
        tied_params_map=tied_params_map,
    )
    add_hook_to_module(module, hook)
    return True


def _block_on_device(module, device, module_name, offload_buffers, skip_keys, tied_params_map) -> None:
    """Hook a block that the maps keep on ``device``: one hook placing all its tensors there, and hooks moving its
    submodules' inputs there."""
    hook = AlignDevicesHook(
        device,
        offload_buffers=offload_buffers,
        io_same_device=module_name == "",
        place_submodules=True,
        skip_keys=skip_keys,
        tied_params_map=tied_params_map,
    )
    add_hook_to_module(module, hook)
    attach_execution_device_hook(module, device, skip_keys=skip_keys, tied_params_map=tied_params_map)


def _offloaded_block(
    module, device, module_name, weights_map, offload_buffers, skip_keys, preload_module_classes, tied_params_map
) -> None:
    """Hook a block whose weights the maps offload: :func:`attach_align_device_hook`'s hooks bring them in for each
    forward on ``device``; the block, if those gave it no hook, and its submodules without one get a hook moving
    their inputs there."""
    attach_align_device_hook(
        module,
        device,
        True,
        weights_map,
        offload_buffers,
        module_name,
        skip_keys,
        preload_module_classes,
        tied_params_map,
    )
    if not hasattr(module, "_hf_hook"):
        add_hook_to_module(
            module,
            AlignDevicesHook(
                device, io_same_device=module_name == "", skip_keys=skip_keys, tied_params_map=tied_params_map
            ),
        )
    attach_execution_device_hook(module, device, skip_keys, preload_module_classes, tied_params_map)


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

    A block named in both maps and not offloaded gets one hook placing all its tensors on its device (and its
    submodules hooks moving their inputs there); an offloaded block gets :func:`attach_align_device_hook`'s
    hooks; the root always gets a hook giving outputs back where the inputs came from. Every submodule is then
    visited, as in Accelerate. Where the maps name a module's own tensors one by one and offload one of them,
    that module gets a hook bringing its weights in (Accelerate attaches none and the forward fails).

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
    if not isinstance(execution_device, Mapping) and not isinstance(offload, dict):
        _uniform(
            module, execution_device, offload, weights_map, offload_buffers, module_name, skip_keys, tied_params_map
        )
        return
    if not isinstance(execution_device, Mapping):
        execution_device = dict.fromkeys(offload, execution_device)
    if not isinstance(offload, Mapping):
        offload = dict.fromkeys(execution_device, offload)
    mapped = module_name in execution_device and module_name in offload
    if mapped and not offload[module_name]:
        _block_on_device(
            module, execution_device[module_name], module_name, offload_buffers, skip_keys, tied_params_map
        )
    elif mapped:
        _offloaded_block(
            module,
            execution_device[module_name],
            module_name,
            weights_map,
            offload_buffers,
            skip_keys,
            preload_module_classes,
            tied_params_map,
        )
    elif not _offloaded_tensor_entries(
        module, module_name, execution_device, offload, weights_map, offload_buffers, skip_keys, tied_params_map
    ):
        if module_name == "":
            root = AlignDevicesHook(
                execution_device.get(""), io_same_device=True, skip_keys=skip_keys, tied_params_map=tied_params_map
            )
            add_hook_to_module(module, root)
    for child_name, child in module.named_children():
        attach_align_device_hook_on_blocks(
            child,
            execution_device,
            offload,
            weights_map,
            offload_buffers,
            f"{module_name}.{child_name}" if module_name else child_name,
            skip_keys,
            preload_module_classes,
            tied_params_map,
        )
