"""Running models larger than one device: empty init, dispatch over GPUs, CPU and disk, offloading.

The usual path is three calls::

    with init_empty_weights():
        model = MyModel(config)            # no memory used: every weight is on the meta device
    model = load_checkpoint_and_dispatch(model, "checkpoint_dir", device_map="auto",
                                         max_memory={0: "10GiB", "cpu": "30GiB"},
                                         no_split_module_classes=["Block"], offload_folder="offload")
    output = model(inputs)                # each block runs on its device; offloaded ones stream in

See ``docs/big_models.md``.
"""

from __future__ import annotations

import contextlib
import functools
import re
import warnings
from collections.abc import Mapping

import torch
from torch import nn

from .. import environment
from ..errors import ConfigError, NotSupportedError, did_you_mean
from ..runtime.parallelism_handlers import (
    refuse_recurrent_layers as _refuse_recurrent_layers_under_sequence_parallelism,  # noqa: F401  (Accelerate's private name, imported by its tests)
)
from ..runtime.weights.offloaded import cpu_state_dict
from .checkpoint_loading import load_checkpoint_in_model
from .device_map import DEVICE_MAP_STRATEGIES, check_device_map, get_balanced_memory, infer_auto_device_map
from .hook_attach import attach_align_device_hook, attach_align_device_hook_on_blocks
from .hooks import (
    SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING,
    AlignDevicesHook,
    CpuOffload,
    LayerwiseCastingHook,
    UserCpuOffloadHook,
    add_hook_to_module,
)
from .modeling import find_tied_parameters, retie_parameters
from .offload import OffloadedWeightsLoader, extract_submodules_state_dict, offload_state_dict, read_offload_index
from .tensors import as_device, get_module_tensor, moved_parameter, named_module_tensors


@contextlib.contextmanager
def init_on_device(device, include_buffers: bool | None = None):
    """Inside this context, new parameters (and buffers with ``include_buffers``) are created on ``device``.

    As in Accelerate: with ``include_buffers`` every tensor is created on ``device`` directly (``device`` is the
    default device inside the context) and nothing is patched; without it, ``nn.Module.register_parameter`` is
    replaced for the context's duration, so that each parameter moves to ``device`` as it is registered (keeping
    its class, ``requires_grad`` and transformers' ``_is_hf_initialized`` mark), and the original is put back on
    exit, even when the body raises. ``register_buffer`` is never touched.

    Unlike Accelerate, a parameter already on ``device`` is registered as it is, so weights tied inside the context
    (``self.head.weight = self.embed.weight``) stay tied; Accelerate wraps it in a new parameter, which unties them.

    Args:
        device: e.g. ``"meta"``, ``"cuda:0"`` or a ``torch.device``.
        include_buffers: put buffers on ``device`` too. Defaults to the ``HASTEN_INIT_INCLUDE_BUFFERS`` (or
            ``ACCELERATE_INIT_INCLUDE_BUFFERS``) setting, off.

    Note:
        The patch is process-wide while the context is active; do not build modules in other threads meanwhile.
    """
    if include_buffers is None:
        include_buffers = environment.get_flag("INIT_INCLUDE_BUFFERS")
    if include_buffers:
        with torch.device(device) if not isinstance(device, torch.device) else device:
            yield
        return
    original = nn.Module.register_parameter

    def register_parameter(module, name, param):
        original(module, name, param)
        registered = module._parameters[name]
        if param is not None and registered.device != torch.device(device):
            module._parameters[name] = moved_parameter(registered, registered.to(device))

    nn.Module.register_parameter = register_parameter
    try:
        yield
    finally:
        nn.Module.register_parameter = original


@contextlib.contextmanager
def init_empty_weights(include_buffers: bool | None = None):
    """Inside this context, models are built without allocating their weights (on the meta device).

    A model of any size is created in a moment; load its weights with
    :func:`load_checkpoint_and_dispatch` or :func:`hasten.load_checkpoint_in_model`.

    Args:
        include_buffers: put buffers on the meta device too (default: the
            ``HASTEN_INIT_INCLUDE_BUFFERS`` setting, off, so buffers such as position ids keep their values).

    Example:
        >>> with init_empty_weights():
        ...     model = nn.Sequential(*[nn.Linear(10_000, 10_000) for _ in range(1000)])  # 400 GB, no memory used
    """
    with init_on_device(torch.device("meta"), include_buffers=include_buffers):
        yield


def _main_device(device_map: Mapping):
    for device in device_map.values():
        if device != "disk" and device.type not in ("cpu", "meta"):
            return device
    return torch.device("cpu")


def _moves_device(args, kwargs) -> bool:
    if kwargs.get("device") is not None:
        return True
    return any(isinstance(arg, (str, int, torch.device, torch.Tensor)) and not isinstance(arg, bool) for arg in args)


def _guard_moves(model: nn.Module) -> None:
    """Warn when a dispatched model is moved, and refuse when it has offloaded weights (``to`` and the accelerator's
    own method, the ones Accelerate wraps and :func:`~hasten.hooks.remove_hook_from_module` unwraps)."""
    kind = environment.accelerator_type()
    for name in ("to", "xpu" if kind == "xpu" else "cuda"):
        method = getattr(model, name)

        def guard(*args, _method=method, _name=name, **kwargs):
            if _name == "to" and not _moves_device(args, kwargs):
                return _method(*args, **kwargs)
            if any(param.device.type == "meta" for param in model.parameters()):
                raise NotSupportedError(
                    f"model.{_name}() cannot move a dispatched model with offloaded weights. Remove the hooks first "
                    "with hasten.hooks.remove_hook_from_module(model, recurse=True), or dispatch it again with another "
                    "device_map."
                )
            warnings.warn(
                f"model.{_name}() moves a model dispatched with a device_map; its hooks still expect the old devices.",
                stacklevel=2,
            )
            return _method(*args, **kwargs)

        setattr(model, name, functools.update_wrapper(guard, method))


def _offload_names(model: nn.Module, device_map: Mapping, offload_devices: set) -> list[str]:
    """Device-map entries that are offloaded, plus the other own tensors of a module split at tensor level."""
    tensors = {name for name, _ in named_module_tensors(model, recurse=True)}
    names = [name for name, device in device_map.items() if str(device) in offload_devices]
    for name in list(names):
        if name in tensors and "." in name:
            owner = name.rsplit(".", 1)[0]
            names += [
                f"{owner}.{leaf}"
                for leaf, _ in named_module_tensors(model.get_submodule(owner))
                if f"{owner}.{leaf}" not in names
            ]
    return names


def _disk_weights(model, device_map, offload_dir, offload_index, offload_buffers) -> None:
    disk = [name for name, device in device_map.items() if device == "disk"]
    if not disk:
        return
    if offload_dir is None and offload_index is None:
        raise ConfigError(
            "The device_map offloads "
            f"{', '.join(name or 'the whole model' for name in disk[:5])}{' ...' if len(disk) > 5 else ''} to disk: "
            "pass offload_dir=<a folder> (or the offload_index of weights already offloaded)."
        )
    if offload_index is not None:
        return
    known = read_offload_index(offload_dir)
    state = extract_submodules_state_dict(model.state_dict(keep_vars=True), disk)
    if not offload_buffers:
        buffers = {name for name, _ in model.named_buffers()}
        state = {name: tensor for name, tensor in state.items() if name not in buffers}
    todo = {name: tensor for name, tensor in state.items() if name not in known}
    empty = [name for name, tensor in todo.items() if tensor.device.type == "meta"]
    if empty:
        raise ConfigError(
            f"These weights are mapped to disk but have no data (meta device) and are not in {offload_dir}: "
            f"{', '.join(empty[:10])}. Load the checkpoint first (load_checkpoint_and_dispatch does it)."
        )
    if todo:
        offload_state_dict(offload_dir, {name: tensor.detach() for name, tensor in todo.items()})


def dispatch_model(
    model: nn.Module,
    device_map: Mapping,
    main_device=None,
    state_dict: Mapping | None = None,
    offload_dir=None,
    offload_index: Mapping | None = None,
    offload_buffers: bool = False,
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    force_hooks: bool = False,
) -> nn.Module:
    """Place a model's blocks per ``device_map`` and attach the hooks that run it across those devices.

    Each block runs on its device; its inputs are moved there first. Blocks mapped to ``"cpu"`` (when
    an accelerator is used) or ``"disk"`` run on ``main_device``: their weights are brought there for
    their forward and dropped after it (disk weights are memory-mapped, not copied into RAM first).
    The model's output comes back on the device its inputs came from.

    Args:
        model: the model, with its weights loaded (offloaded ones may be on the meta device).
        device_map: ``{name: device}`` covering every parameter and buffer.
        main_device: where offloaded blocks run (default: the first accelerator in the map, else the CPU).
        state_dict: the weights of the blocks mapped to ``"cpu"`` (taken from the model when None).
        offload_dir: folder of the disk-offloaded weights (written there from the model if missing).
        offload_index: an offload index to use instead of ``offload_dir/index.json``.
        offload_buffers: offload buffers too; otherwise they stay on the execution device.
        skip_keys: keys of mapping inputs that are not moved between devices.
        preload_module_classes: class names whose whole weights are loaded before their forward.
        force_hooks: attach hooks even when the whole model is on one device.

    Returns:
        The model, with ``model.hf_device_map`` set to the device map.
    """
    check_device_map(model, device_map)
    devices = {name: as_device(device) for name, device in device_map.items()}
    if main_device is None:
        main_device = _main_device(devices)
    main_device = as_device(main_device)
    if len({str(device) for device in devices.values()}) == 1 and not force_hooks and "disk" not in devices.values():
        return _dispatch_whole(model, devices, device_map)
    offload_devices = {"disk"} if main_device.type in ("cpu", "mps") else {"cpu", "disk"}
    in_memory = [name for name in _offload_names(model, devices, offload_devices) if str(devices.get(name)) != "disk"]
    if state_dict is None and in_memory:
        state_dict = extract_submodules_state_dict(model.state_dict(), in_memory)
    _disk_weights(model, devices, offload_dir, offload_index, offload_buffers)
    uses_disk = any(device == "disk" for device in devices.values())
    weights_map = None
    if state_dict is not None or uses_disk:
        weights_map = OffloadedWeightsLoader(
            state_dict=state_dict, save_folder=offload_dir if uses_disk else None, index=offload_index
        )
    execution = {name: main_device if str(device) in offload_devices else device for name, device in devices.items()}
    execution.setdefault("", main_device)
    offload = {name: str(device) in offload_devices for name, device in devices.items()}
    tied = find_tied_parameters(model)
    tied_map = {}
    for group in tied:
        tensor = get_module_tensor(model, group[0])
        if tensor.device.type != "meta":
            tied_map[tensor.data_ptr()] = {}
    attach_align_device_hook_on_blocks(
        model,
        execution,
        offload,
        weights_map,
        offload_buffers,
        skip_keys=skip_keys,
        preload_module_classes=preload_module_classes,
        tied_params_map=tied_map,
    )
    retie_parameters(model, tied)
    _guard_moves(model)
    model.hf_device_map = dict(device_map)
    return model


def _dispatch_whole(model: nn.Module, devices: Mapping, device_map: Mapping) -> nn.Module:
    device = next(iter(devices.values()))
    empty = [name for name, tensor in named_module_tensors(model, recurse=True) if tensor.device.type == "meta"]
    if empty and device.type != "meta":
        raise ConfigError(
            f"Cannot move the model to {device}: these tensors have no data (meta device): {', '.join(empty[:10])}. "
            "Load the checkpoint first (hasten.load_checkpoint_in_model)."
        )
    model.to(device)
    model.hf_device_map = dict(device_map)
    return model


def cpu_offload(
    model: nn.Module,
    execution_device=None,
    offload_buffers: bool = False,
    state_dict: Mapping | None = None,
    preload_module_classes: list[str] | None = None,
) -> nn.Module:
    """Keep the weights in RAM and bring each submodule's weights to ``execution_device`` for its forward.

    Args:
        model: the model.
        execution_device: where the forwards run (default: the device of the model's first parameter).
        offload_buffers: offload buffers too.
        state_dict: the weights to use (the model's own, on the CPU, when None).
        preload_module_classes: class names whose whole weights are loaded before their forward.
    """
    if execution_device is None:
        execution_device = next(iter(model.parameters())).device
    if state_dict is None:
        state_dict = {name: tensor.to("cpu") for name, tensor in model.state_dict().items()}
    add_hook_to_module(model, AlignDevicesHook(io_same_device=True), append=True)
    attach_align_device_hook(
        model,
        execution_device,
        offload=True,
        weights_map=state_dict,
        offload_buffers=offload_buffers,
        preload_module_classes=preload_module_classes,
    )
    return model


def cpu_offload_with_hook(model: nn.Module, execution_device=None, prev_module_hook: UserCpuOffloadHook | None = None):
    """Keep a whole model on the CPU and move it to ``execution_device`` when it is called.

    The model stays there until the next model of a pipeline starts (its ``prev_module_hook`` is this
    one's handle) or until ``hook.offload()``: much faster than :func:`cpu_offload` when a model is
    called in a loop.

    Returns:
        ``(model, hook)`` where ``hook`` is a :class:`~hasten.hooks.UserCpuOffloadHook`.

    Example:
        >>> model_1, hook_1 = cpu_offload_with_hook(model_1, "cuda:0")
        >>> model_2, hook_2 = cpu_offload_with_hook(model_2, "cuda:0", prev_module_hook=hook_1)
        >>> hidden = model_1(x); out = model_2(hidden)   # model_1 goes back to the CPU as model_2 starts
        >>> hook_2.offload()
    """
    hook = CpuOffload(execution_device=execution_device, prev_module_hook=prev_module_hook)
    add_hook_to_module(model, hook, append=True)
    return model, UserCpuOffloadHook(model, hook)


def disk_offload(
    model: nn.Module,
    offload_dir,
    execution_device=None,
    offload_buffers: bool = False,
    preload_module_classes: list[str] | None = None,
) -> nn.Module:
    """Keep the weights on disk (memory-mapped ``.dat`` files) and bring each submodule's in for its forward.

    The weights are written to ``offload_dir`` unless it already holds an offload index.

    Args:
        model: the model.
        offload_dir: the folder of the offloaded weights.
        execution_device: where the forwards run (default: the device of the model's first parameter).
        offload_buffers: offload buffers too.
        preload_module_classes: class names whose whole weights are loaded before their forward.
    """
    if not read_offload_index(offload_dir):
        offload_state_dict(offload_dir, {name: tensor.detach() for name, tensor in model.state_dict().items()})
    if execution_device is None:
        execution_device = next(iter(model.parameters())).device
    weights_map = OffloadedWeightsLoader(save_folder=offload_dir)
    add_hook_to_module(model, AlignDevicesHook(io_same_device=True), append=True)
    attach_align_device_hook(
        model,
        execution_device,
        offload=True,
        weights_map=weights_map,
        offload_buffers=offload_buffers,
        preload_module_classes=preload_module_classes,
    )
    return model


def load_checkpoint_and_dispatch(
    model: nn.Module,
    checkpoint,
    device_map: Mapping | str | None = None,
    max_memory: Mapping | None = None,
    no_split_module_classes: list[str] | None = None,
    offload_folder=None,
    offload_buffers: bool = False,
    dtype: str | torch.dtype | None = None,
    offload_state_dict: bool | None = None,
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    force_hooks: bool = False,
    strict: bool = False,
    full_state_dict: bool = True,
    broadcast_from_rank0: bool = False,
) -> nn.Module:
    """Load a checkpoint into a (typically empty) model and dispatch it over the devices.

    Args:
        model: the model, usually built under :func:`init_empty_weights`.
        checkpoint: a weights file, an index file or a folder.
        device_map: a ``{name: device}`` dict, or ``"auto"``/``"balanced"`` (even over the GPUs),
            ``"balanced_low_0"`` (GPU 0 kept as empty as possible) or ``"sequential"`` (fill GPUs in
            order); None loads without dispatching.
        max_memory: budgets per device for the strategies (all free memory when None).
        no_split_module_classes: class names never split across devices.
        offload_folder: where disk-offloaded weights and the offload index go.
        offload_buffers: offload buffers too.
        dtype: cast floating-point weights to this dtype.
        offload_state_dict: see :func:`hasten.load_checkpoint_in_model` (off by default: hasten reads
            one tensor at a time, so staging CPU weights on disk saves nothing).
        skip_keys: keys of mapping inputs that are not moved between devices.
        preload_module_classes: class names whose whole weights are loaded before their forward.
        force_hooks: attach hooks even when the whole model is on one device.
        strict: raise on missing or unexpected keys.
        full_state_dict: see :func:`hasten.load_checkpoint_in_model`.
        broadcast_from_rank0: see :func:`hasten.load_checkpoint_in_model`.

    Returns:
        The model, ready to run.
    """
    if isinstance(device_map, str):
        if device_map not in DEVICE_MAP_STRATEGIES:
            raise ConfigError(
                f"Unknown device_map {device_map!r}: expected a dict or one of {list(DEVICE_MAP_STRATEGIES)}."
                f"{did_you_mean(device_map, DEVICE_MAP_STRATEGIES)}"
            )
        if device_map != "sequential":
            max_memory = get_balanced_memory(
                model, max_memory, no_split_module_classes, dtype, low_zero=device_map == "balanced_low_0"
            )
        device_map = infer_auto_device_map(
            model, max_memory, no_split_module_classes, dtype, offload_buffers=offload_buffers
        )
    load_checkpoint_in_model(
        model,
        checkpoint,
        device_map=device_map,
        offload_folder=offload_folder,
        dtype=dtype,
        offload_state_dict=bool(offload_state_dict),
        offload_buffers=offload_buffers,
        strict=strict,
        full_state_dict=full_state_dict,
        broadcast_from_rank0=broadcast_from_rank0,
    )
    if device_map is None:
        return model
    return dispatch_model(
        model,
        device_map,
        offload_dir=offload_folder,
        offload_buffers=offload_buffers,
        skip_keys=skip_keys,
        preload_module_classes=preload_module_classes,
        force_hooks=force_hooks,
    )


def get_state_dict_offloaded_model(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict of a model whose weights may be offloaded, every parameter on the CPU.

    Offloaded weights are brought in module by module (disk weights stay memory-mapped); see
    :func:`hasten.runtime.weights.offloaded.cpu_state_dict`, which engines and checkpoints use.
    """
    return cpu_state_dict(model)


def attach_layerwise_casting_hooks(
    module: nn.Module,
    storage_dtype: torch.dtype,
    compute_dtype: torch.dtype,
    skip_modules_pattern: str | tuple[str, ...] | None = None,
    skip_modules_classes: tuple[type[nn.Module], ...] | None = None,
    non_blocking: bool = False,
) -> None:
    """Store the weights of ``module``'s convolution and linear layers in ``storage_dtype`` and compute in
    ``compute_dtype``: a :class:`~hasten.hooks.LayerwiseCastingHook` on each such layer.

    Layers whose dotted name matches a regular expression of ``skip_modules_pattern`` (searched, not matched),
    or whose class is in ``skip_modules_classes``, and everything under them, keep their dtype.
    """
    patterns = (skip_modules_pattern,) if isinstance(skip_modules_pattern, str) else tuple(skip_modules_pattern or ())
    pending = [("", module)]
    while pending:
        name, current = pending.pop()
        if (skip_modules_classes and isinstance(current, skip_modules_classes)) or any(
            re.search(p, name) for p in patterns
        ):
            continue
        if isinstance(current, SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING):
            add_hook_to_module(current, LayerwiseCastingHook(storage_dtype, compute_dtype, non_blocking), append=True)
            continue
        pending.extend((f"{name}.{child}" if name else child, sub) for child, sub in current.named_children())
