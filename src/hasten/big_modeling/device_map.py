"""Device maps: which module of a model lives on which GPU, on the CPU, or on disk.

A device map is a dict ``{module_or_tensor_name: device}`` where ``device`` is an accelerator index,
``"cpu"`` or ``"disk"``; ``{"": 0}`` puts the whole model on GPU 0. A tensor's device is the value of
the longest name in the map that is a prefix of the tensor's name.

:func:`infer_auto_device_map` computes one from memory budgets, :func:`get_balanced_memory` turns
free memory into budgets that spread a model evenly over several GPUs.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping

import torch
from torch import nn

from ..errors import ConfigError, did_you_mean
from .modeling import (
    compute_module_sizes,
    find_tied_parameters,
    get_max_layer_size,
    get_non_persistent_buffers,
    is_atomic,
    module_parts,
    named_module_tensors,
    parse_dtype,
    tensor_size,
)
from ..runtime.fileio import parse_size

DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
_NAMED_DEVICES = ("mps", "xpu", "cpu", "disk")


def _memory_key(key):
    if isinstance(key, bool):
        raise ConfigError(f"max_memory key {key!r} is not a device.")
    if isinstance(key, int) and key >= 0:
        return key
    if isinstance(key, torch.device):
        key = str(key)
    if isinstance(key, str):
        if key in _NAMED_DEVICES:
            return key
        kind, _, index = key.partition(":")
        if kind in ("cuda", "xpu") and index.isdigit():
            return int(index)
    raise ConfigError(
        f"max_memory key {key!r} is not a device: use accelerator indices (0, 1, ...), 'cpu', 'mps' or 'disk'"
        f" (e.g. max_memory={{0: '10GiB', 'cpu': '30GiB'}}).{did_you_mean(str(key), _NAMED_DEVICES)}"
    )


def _available_memory() -> dict:
    import psutil

    from ..environment import accelerator_type, device_count

    memory: dict = {}
    kind = accelerator_type()
    if kind in ("cuda", "xpu"):
        backend = getattr(torch, kind)
        for index in range(device_count(kind)):
            memory[index] = backend.mem_get_info(index)[0]
    elif kind == "mps":
        memory["mps"] = psutil.virtual_memory().available
    memory["cpu"] = psutil.virtual_memory().available
    return memory


def get_max_memory(max_memory: Mapping | None = None) -> dict:
    """Memory budgets per device, in bytes, ordered accelerators first, then ``"cpu"``, then ``"disk"``.

    Args:
        max_memory: ``{device: size}`` with sizes as ints or strings (``"10GiB"``, ``"500MB"``); when
            None, the free memory of every visible accelerator and the available RAM.

    Raises:
        ConfigError: a key is not a device or a size cannot be parsed.
    """
    if max_memory is None:
        return _available_memory()
    budgets = {}
    for key, value in max_memory.items():
        budgets[_memory_key(key)] = parse_size(value)
    indices = sorted(key for key in budgets if isinstance(key, int))
    named = [key for key in _NAMED_DEVICES if key in budgets]
    return {key: budgets[key] for key in indices + named}


def _dfs_order(model: nn.Module, entries: Mapping[str, object]) -> dict:
    ordered: dict = {}

    def visit(name: str, obj) -> None:
        if name in entries:
            ordered[name] = entries[name]
        elif isinstance(obj, nn.Module):
            for part_name, part in module_parts(obj, name):
                visit(part_name, part)

    visit("", model)
    return ordered


def _merge_entries(model: nn.Module, device_map: Mapping[str, object]) -> dict:
    """Replace the entries of a module's parts by one entry for the module when they share a device."""
    entries = dict(device_map)

    def merge(name: str, obj):
        if name in entries:
            return entries[name]
        if not isinstance(obj, nn.Module):
            return None
        parts = module_parts(obj, name)
        devices = [merge(part_name, part) for part_name, part in parts]
        if not parts or any(d is None for d in devices) or len(set(map(str, devices))) != 1:
            return None
        for part_name, _ in parts:
            entries.pop(part_name, None)
        entries[name] = devices[0]
        return devices[0]

    merge("", model)
    return _dfs_order(model, entries)


class _Planner:
    """Greedy placement of a model's parts on devices in order, as :func:`infer_auto_device_map` documents."""

    def __init__(self, model, limits: dict, no_split: set, dtype, special_dtypes, verbose: bool, fallback: bool):
        self.model, self.limits, self.no_split = model, limits, no_split
        self.verbose, self.fallback = verbose, fallback
        self.devices = list(limits)
        self.sizes = compute_module_sizes(model, dtype, special_dtypes)
        self.placed: dict = {}
        self.used = dict.fromkeys(self.devices, 0)
        self._ties = self._tie_groups(dtype, special_dtypes or {})

    def _tie_groups(self, dtype, special) -> list[tuple[list[str], str, int]]:
        tensors = dict(self.model.named_parameters(remove_duplicate=False))
        order = list(tensors)
        groups = []
        for names in find_tied_parameters(self.model):
            first = min(names, key=order.index)
            tensor = tensors[first]
            size = tensor.numel() * parse_dtype(special[first]).itemsize if first in special else tensor_size(tensor, dtype)
            groups.append((names, first, size))
        return groups

    @staticmethod
    def _inside(name: str, unit: str) -> bool:
        return unit == "" or name == unit or name.startswith(unit + ".")

    def _device_of(self, name: str):
        parts = name.split(".")
        for depth in range(len(parts), -1, -1):
            prefix = ".".join(parts[:depth])
            if prefix in self.placed:
                return self.placed[prefix]
        return None

    def _unit_of(self, tensor_name: str) -> str:
        parts, module = tensor_name.split("."), self.model
        for depth, part in enumerate(parts[:-1]):
            module = module._modules[part]
            if type(module).__name__ in self.no_split:
                return ".".join(parts[: depth + 1])
        return ".".join(parts[:-1]) if len(parts) > 1 and not module._modules else tensor_name

    def _partners(self, name: str) -> list[str]:
        units: list[str] = []
        for names, _, _ in self._ties:
            if not any(self._inside(member, name) for member in names):
                continue
            for member in names:
                if not self._inside(member, name) and self._device_of(member) is None:
                    unit = self._unit_of(member)
                    if unit not in units:
                        units.append(unit)
        return units

    def _cost(self, units: list[str], device) -> int:
        cost = sum(self.sizes.get(unit, 0) for unit in units)
        for names, first, size in self._ties:
            touched = any(self._inside(member, unit) for member in names for unit in units)
            counted = any(self._inside(first, unit) for unit in units) or self._device_of(first) == device
            if touched and not counted:
                cost += size
        return cost

    def _fits(self, units: list[str], device) -> bool:
        return self._cost(units, device) <= self.limits[device] - self.used[device]

    def _place(self, units: list[str], device) -> None:
        self.used[device] += self._cost(units, device)
        for unit in units:
            self.placed[unit] = device
        if self.verbose:
            print(f"Placing {', '.join(repr(u) for u in units)} on {device!r} ({self.used[device]} bytes used).")

    def _holds_placed(self, name: str) -> bool:
        return any(unit != name and self._inside(unit, name) for unit in self.placed)

    def _fallback_unit(self, queue: list, device) -> str | None:
        pending = list(queue)
        while pending:
            name, obj = pending.pop(0)
            if name in self.placed:
                continue
            if is_atomic(obj, self.no_split) and self._fits([name], device):
                return name
            if not is_atomic(obj, self.no_split):
                pending = module_parts(obj, name) + pending
        return None

    def run(self) -> dict:
        queue = module_parts(self.model, "")
        index = 0
        while queue:
            name, obj = queue.pop(0)
            if name in self.placed:
                continue
            if self._holds_placed(name):
                queue[:0] = module_parts(obj, name)
                continue
            device = self.devices[index]
            partners = self._partners(name)
            if self._fits([name, *partners], device):
                self._place([name, *partners], device)
            elif not is_atomic(obj, self.no_split):
                queue[:0] = module_parts(obj, name)
            elif partners and self._fits([name], device):
                self._place([name], device)
            else:
                unit = None
                if self.fallback and device != "disk" and not self.used[device]:
                    unit = self._fallback_unit([(name, obj), *queue], device)
                if unit is not None:
                    self._place([unit], device)
                else:
                    if self.verbose:
                        print(f"{name!r} ({self.sizes.get(name, 0)} bytes) does not fit on {device!r}; moving to the next device.")
                    index += 1
                queue.insert(0, (name, obj))
        return self.placed


def _offloaded(placed: Mapping, gpus: list) -> bool:
    return any(device == "disk" or (device == "cpu" and gpus) for device in placed.values())


def _warn_buffers(model: nn.Module, placed: dict, planner: _Planner, budgets: dict, main_device, dtype) -> None:
    offload_devices = {"disk", "cpu"} if main_device != "cpu" else {"disk"}
    buffer_sizes = compute_module_sizes(model, dtype, buffers_only=True)
    total = sum(buffer_sizes.get(name, 0) for name, device in placed.items() if device in offload_devices)
    room = budgets.get(main_device, 0) - planner.used.get(main_device, 0)
    if total > room:
        warnings.warn(
            f"The offloaded modules have {total} bytes of buffers, which stay on {main_device!r} where only {room} bytes "
            "are left; if you run out of memory, pass offload_buffers=True.",
            stacklevel=3,
        )


def infer_auto_device_map(
    model: nn.Module,
    max_memory: Mapping | None = None,
    no_split_module_classes: list[str] | None = None,
    dtype: str | torch.dtype | None = None,
    special_dtypes: Mapping[str, str | torch.dtype] | None = None,
    verbose: bool = False,
    clean_result: bool = True,
    offload_buffers: bool = False,
    fallback_allocation: bool = False,
) -> dict:
    """A device map that fills the accelerators in order, then the CPU, then the disk.

    The model's parts are taken in definition order (own parameters, children, own buffers). A part
    goes on the current device if it fits in what is left of that device's budget; otherwise a part
    that can be split (a module with children whose class is not in ``no_split_module_classes``) is
    replaced by its parts, and one that cannot moves everything after it to the next device. Tied
    parameters are placed with the part that uses them first when both fit, and counted once.

    When anything ends up offloaded (on the CPU while an accelerator is used, or on disk), the plan is
    made again with room kept free on the first accelerator and on the CPU for the largest unsplittable
    part, which is where offloaded weights are brought in for their forward.

    Args:
        model: the model, typically built under :func:`hasten.init_empty_weights`.
        max_memory: budgets per device (see :func:`get_max_memory`); all free memory when None.
        no_split_module_classes: class names never split across devices (e.g. transformer blocks
            with residual connections).
        dtype: size floating-point weights as if loaded in this dtype.
        special_dtypes: per-tensor dtypes overriding ``dtype``.
        verbose: print each decision.
        clean_result: merge the entries of a module's parts that landed on one device into one entry.
        offload_buffers: also offload buffers; otherwise the buffers of offloaded modules stay on the
            execution device, and a warning is given when they do not fit there.
        fallback_allocation: when the next part does not fit on a device that is still empty, put the
            first later unsplittable part that fits there instead of leaving the device unused.

    Returns:
        An ordered ``{name: device}`` dict (``{"": device}`` when everything lands on one device).
    """
    budgets = get_max_memory(max_memory)
    budgets["disk"] = math.inf
    no_split = set(no_split_module_classes or ())
    gpus = [device for device in budgets if device not in ("cpu", "disk")]
    main_devices = [gpus[0], "cpu"] if gpus else ["cpu"]
    planner = _Planner(model, dict(budgets), no_split, dtype, special_dtypes, verbose, fallback_allocation)
    placed = planner.run()
    if _offloaded(placed, gpus):
        largest, _ = get_max_layer_size(module_parts(model, ""), planner.sizes, no_split)
        limits = {d: (b - largest if d in main_devices else b) for d, b in budgets.items()}
        if verbose:
            print(f"Offloading needed: keeping {largest} bytes free on {main_devices} for the largest layer.")
        planner = _Planner(model, limits, no_split, dtype, special_dtypes, verbose, fallback_allocation)
        placed = planner.run()
    if not offload_buffers:
        _warn_buffers(model, placed, planner, budgets, main_devices[0], dtype)
    return _merge_entries(model, placed) if clean_result else _dfs_order(model, placed)


def get_balanced_memory(
    model: nn.Module,
    max_memory: Mapping | None = None,
    no_split_module_classes: list[str] | None = None,
    dtype: str | torch.dtype | None = None,
    special_dtypes: Mapping | None = None,
    low_zero: bool = False,
) -> dict:
    """Budgets that make :func:`infer_auto_device_map` spread ``model`` evenly over the accelerators.

    Each accelerator but the last gets the model's size divided by their number, plus a margin of
    1.25 times the largest unsplittable part (so the last layers are not pushed off the accelerators
    by rounding); the last one keeps its whole budget. With ``low_zero``, accelerator 0 only gets what
    does not fit on the others (room is left there for what generation produces). With fewer than two
    accelerators the budgets are returned unchanged.

    Args:
        model: the model.
        max_memory: budgets per device; all free memory when None.
        no_split_module_classes: class names never split across devices.
        dtype: size floating-point weights as if loaded in this dtype.
        special_dtypes: per-tensor dtypes overriding ``dtype``.
        low_zero: keep accelerator 0 as empty as possible.
    """
    budgets = get_max_memory(max_memory)
    gpus = [device for device in budgets if isinstance(device, int) and budgets[device] > 0]
    if len(gpus) < 2:
        return budgets
    sizes = compute_module_sizes(model, dtype, special_dtypes)
    largest, _ = get_max_layer_size(module_parts(model, ""), sizes, set(no_split_module_classes or ()))
    sharing = gpus[1:] if low_zero else gpus
    share = math.ceil(sizes[""] / len(sharing)) + int(1.25 * largest)
    for device in sharing[:-1]:
        budgets[device] = min(share, budgets[device])
    if low_zero:
        rest = sum(budgets[device] for device in sharing)
        budgets[gpus[0]] = min(max(0, sizes[""] - rest), budgets[gpus[0]])
    return budgets


def check_device_map(model: nn.Module, device_map: Mapping) -> None:
    """Check that ``device_map`` names parts of ``model`` and gives every parameter and buffer a device.

    Raises:
        ConfigError: an entry names nothing in the model, or some tensors have no device (listed).
    """
    names = {name for name, _ in model.named_modules(remove_duplicate=False)}
    tensors = [name for name, _ in named_module_tensors(model, recurse=True)]
    for name in device_map:
        if name not in names and name not in tensors:
            raise ConfigError(
                f"device_map entry {name!r} is not a module, parameter or buffer of the model."
                f"{did_you_mean(name, [n for n in names if n] + tensors)}"
            )
    non_persistent = get_non_persistent_buffers(model, recurse=True, fqns=True)
    uncovered = [name for name in tensors if name not in non_persistent and not _covered(name, device_map)]
    if uncovered:
        shown = ", ".join(uncovered[:10]) + (f" and {len(uncovered) - 10} more" if len(uncovered) > 10 else "")
        raise ConfigError(
            f"The device_map gives no device to these tensors: {shown}. Add entries for them (or for their modules), "
            'use {"": device} for the whole model, or let hasten compute one with device_map="auto".'
        )


def _covered(name: str, device_map: Mapping) -> bool:
    parts = name.split(".")
    return any(".".join(parts[:depth]) in device_map for depth in range(len(parts) + 1))


def device_for(name: str, device_map: Mapping):
    """The device ``device_map`` gives to tensor ``name`` (longest matching prefix), or None."""
    parts = name.split(".")
    for depth in range(len(parts), -1, -1):
        prefix = ".".join(parts[:depth])
        if prefix in device_map:
            return device_map[prefix]
    return None


def clean_device_map(device_map: dict, module_name: str = "") -> dict:
    """Collapse the entries under ``module_name`` into one entry for it when they all share one device, recursively.

    Works on the names alone (no model needed): ``{"a.0": 0, "a.1": 0, "b": "cpu"}`` becomes
    ``{"a": 0, "b": "cpu"}``, and a map whose every entry has one device becomes ``{"": device}``.
    ``device_map`` is changed in place and returned, as in Accelerate.

    Args:
        device_map: ``{name: device}``.
        module_name: the module whose entries are collapsed (``""``: the whole model).
    """
    prefix = f"{module_name}." if module_name else ""
    under = [name for name in device_map if name.startswith(prefix)]
    devices = {str(device_map[name]) for name in under}
    if len(under) > 1 and len(devices) == 1:
        device = device_map[under[0]]
        for name in under:
            del device_map[name]
        device_map[module_name] = device
        return device_map
    depth = len(module_name.split(".")) + 1 if module_name else 1
    children = dict.fromkeys(".".join(name.split(".")[:depth]) for name in under if len(name) > len(module_name))
    for child in children:
        clean_device_map(device_map, child)
    return device_map
