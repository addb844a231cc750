"""``infer_auto_device_map``: which module goes on which GPU, on the CPU or on disk, decided as Accelerate 1.15 does.

The model's parts are taken in definition order (own parameters, children, own buffers) and put on the first
device of the budget order (GPUs, ``"mps"``, ``"cpu"``, ``"disk"``) where they fit. On the GPU that runs offloaded
layers (the first one, or ``"mps"``) and on the CPU, room for the largest layer still to be placed is kept free.
A part that does not fit is split into its own parameters and its children (its own buffers are then left to the
parent's entry, as in Accelerate) unless it is a tensor, has no children or is of a no-split class; a part that
cannot be split closes the device. Tied parameters outside a part are placed with it, their modules counted in its
size. Results follow Accelerate's to the byte, its rounding and orderings included: users moving from Accelerate
get the same device maps.
"""

from __future__ import annotations

import logging
import warnings
from collections import OrderedDict
from collections.abc import MutableMapping

import torch
from torch import nn

from .memory import convert_file_size_to_int, get_max_memory
from .modeling import compute_module_sizes, compute_module_total_buffer_size, find_tied_parameters, get_max_layer_size
from .placement import clean_device_map

logger = logging.getLogger(__name__)


def _inside(name: str, other: str) -> bool:
    """Accelerate's test of "``other`` belongs to ``name``": ``name.`` occurs anywhere in ``other.``."""
    return f"{name}." in f"{other}."


def _outside_partners(name: str, tied_groups: list[list[str]]) -> list[str]:
    """The tied parameters outside ``name`` whose group also has a member inside it, group after group."""
    partners: list[str] = []
    for group in tied_groups:
        inside = [_inside(name, member) for member in group]
        if any(inside) and not all(inside):
            partners += [member for member, within in zip(group, inside) if not within]
    return partners


def _parts(name: str, module) -> list[tuple[str, object]]:
    """What a split module becomes: its own parameters, then its children (its own buffers are not listed)."""
    own = list(module.named_parameters(recurse=False)) + list(module.named_children())
    return [(f"{name}.{part}", value) for part, value in own]


def _splittable(part, no_split: list[str]) -> bool:
    """A module with children whose class may be split (a tensor never is)."""
    if isinstance(part, torch.Tensor):
        return False
    return any(True for _ in part.named_children()) and type(part).__name__ not in no_split


def _with_ties(partners: list[str], size, sizes, queue: list) -> tuple[object, list[str], list]:
    """``size`` plus the modules in ``queue`` holding ``partners`` (each counted without its tied tensor).

    Raises IndexError when a partner is in no module of ``queue``, as Accelerate does.
    """
    names, modules = [], []
    for partner in partners:
        holder, module = [(n, m) for n, m in queue if partner.startswith(n + ".")][0]
        names.append(holder)
        modules.append(module)
    for partner, holder in zip(partners, names):
        size += sizes[holder] - sizes[partner]
    return size, names, modules


def _fallback_search(queue: list, sizes, limit, no_split: list[str], tied_groups: list[list[str]]):
    """The first part (depth first through splittable modules) that fits in ``limit`` with its tied modules.

    Returns ``(name, part, queue)`` with the part taken out of the queue (its ancestors there replaced by their
    parts), or ``(None, None, queue)``. A limit that is not a size (negative) finds nothing.
    """
    try:
        limit = convert_file_size_to_int(limit)
    except ValueError:
        return None, None, queue
    pending = list(queue)
    found = None
    while pending:
        name, part = pending.pop(0)
        size, _, _ = _with_ties(_outside_partners(name, tied_groups), sizes[name], sizes, pending)
        if size <= limit:
            found = name
            break
        if _splittable(part, no_split):
            pending = _parts(name, part) + pending
    if found is None:
        return None, None, queue
    for cut in (index for index, char in enumerate(found) if char == "."):
        parent = found[:cut]
        names = [n for n, _ in queue]
        if parent in names:
            position = names.index(parent)
            queue = queue[:position] + _parts(parent, queue[position][1]) + queue[position + 1 :]
    position = [n for n, _ in queue].index(found)
    name, part = queue.pop(position)
    return name, part, queue


class _Planner:
    """One run of the placement loop; ``run`` returns the raw (uncleaned) device map."""

    def __init__(self, model, budgets: dict, no_split: list[str], dtype, special_dtypes, options: dict):
        self.budgets, self.no_split = budgets, no_split
        self.dtype, self.special_dtypes = dtype, special_dtypes
        self.offload_buffers, self.fallback, self.verbose = (
            options["offload_buffers"],
            options["fallback"],
            options["verbose"],
        )
        self.devices = list(budgets) + ([] if "disk" in budgets else ["disk"])
        self.gpus = [device for device in self.devices if device not in ("cpu", "disk")]
        self.main_devices = ["mps"] if "mps" in self.gpus else [self.gpus[0], "cpu"] if self.gpus else ["cpu"]
        self.sizes = compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes)
        self.tied_groups = find_tied_parameters(model)
        self.queue = (
            list(model.named_parameters(recurse=False))
            + list(model.named_children())
            + list(model.named_buffers(recurse=False))
        )
        self.device_map: OrderedDict = OrderedDict()
        self.used = dict.fromkeys(self.devices, 0)
        self.buffer_sizes: dict = {}
        self.current = 0
        self.largest, self.largest_names = get_max_layer_size(self.queue, self.sizes, no_split)

    def _say(self, message: str) -> None:
        if self.verbose:
            print(message)

    def _update_largest(self) -> None:
        modules = [(n, m) for n, m in self.queue if isinstance(m, nn.Module)]
        self.largest, self.largest_names = get_max_layer_size(modules, self.sizes, self.no_split)

    def _place(self, name: str, module, device, size, tied_names: list[str]) -> None:
        self.used[device] += size
        self.device_map[name] = device
        for tied in tied_names:
            position = next((i for i, (n, _) in enumerate(self.queue) if n == tied), None)
            if position is not None:
                self.queue.pop(position)
            self.device_map[tied] = device
        if not self.offload_buffers and isinstance(module, nn.Module):
            buffers = compute_module_total_buffer_size(module, dtype=self.dtype, special_dtypes=self.special_dtypes)
            self.buffer_sizes[device] = self.buffer_sizes.get(device, 0) + buffers

    def _split_a_tied_module(self, name: str, module, tied_names: list[str], tied_modules: list) -> bool:
        for tied_name, tied_module in zip(tied_names, tied_modules):
            if not _splittable(tied_module, self.no_split):
                continue
            position = [i for i, (n, _) in enumerate(self.queue) if n == tied_name][0]
            self.queue = (
                [(name, module)] + self.queue[:position] + _parts(tied_name, tied_module) + self.queue[position + 1 :]
            )
            self._update_largest()
            return True
        return False

    def _step(self) -> None:
        name, module = self.queue.pop(0)
        self.largest_names = [n for n in self.largest_names if n != name and not n.startswith(name + ".")]
        if not self.largest_names:
            self._update_largest()
        size = self.sizes[name]
        partners = _outside_partners(name, self.tied_groups)
        device = self.devices[self.current]
        limit = None if device == "disk" else self.budgets[device]
        reserved = 0
        if device in self.main_devices:
            limit, reserved = limit - self.largest, self.largest
        total, tied_names, tied_modules = (
            _with_ties(partners, size, self.sizes, self.queue) if partners else (size, [], [])
        )
        if limit is None or self.used[device] + total <= limit:
            self._say(f"{name!r} ({total} bytes with {tied_names or 'no tied modules'}) goes on {device!r}.")
            self._place(name, module, device, total, tied_names)
            return
        if (
            partners
            and self.used[device] + size <= limit
            and self._split_a_tied_module(name, module, tied_names, tied_modules)
        ):
            self._say(f"{name!r} fits on {device!r} but not with its tied modules {tied_names}: splitting one of them.")
            return
        if self.used[device] + size >= limit and _splittable(module, self.no_split):
            self._say(
                f"{name!r} ({size} bytes) does not fit in the {limit - self.used[device]} bytes left on {device!r}: "
                "splitting it."
            )
            self.queue = _parts(name, module) + self.queue
            self._update_largest()
            return
        if self.used[device] == 0 and self.fallback and device != "disk":
            limit = self.budgets[device] - max(self.largest, total)
            found, part, rest = _fallback_search(self.queue, self.sizes, limit, self.no_split, self.tied_groups)
            if part is not None:
                self._say(f"{name!r} does not fit on the empty {device!r}; {found!r} fits there and goes first.")
                self.queue = [(found, part), (name, module)] + rest
                return
        if self.used[device] == 0:
            logger.info(
                "No module could be assigned to %s for insufficient memory: %s bytes would be needed.",
                device,
                total + reserved,
            )
        self._say(
            f"{name!r} ({total} bytes) cannot be split and does not fit on {device!r}: moving to the next device."
        )
        self.used[device] += reserved
        self.current += 1
        self.queue.insert(0, (name, module))

    def run(self) -> OrderedDict:
        while self.queue:
            self._step()
        return self.device_map


def _warn_offloaded_buffers(planner: _Planner, budgets: dict) -> None:
    offloaded = planner.buffer_sizes.get("cpu", 0) + planner.buffer_sizes.get("disk", 0)
    if offloaded <= 0:
        return
    used = {device: amount for device, amount in planner.used.items() if amount > 0}
    fits = any(
        budget >= offloaded + used.get(device, 0) for device, budget in budgets.items() if device not in ("cpu", "disk")
    )
    if planner.gpus and not fits:
        warnings.warn(
            f"The offloaded layers need {offloaded} bytes of buffers on the GPU that runs them, more than any GPU has "
            "left. If you run out of memory, pass offload_buffers=True.",
            stacklevel=3,
        )


def infer_auto_device_map(
    model: nn.Module,
    max_memory: MutableMapping | None = None,
    no_split_module_classes: list[str] | None = None,
    dtype: str | torch.dtype | None = None,
    special_dtypes: dict | None = None,
    verbose: bool = False,
    clean_result: bool = True,
    offload_buffers: bool = False,
    fallback_allocation: bool = False,
) -> OrderedDict:
    """A device map that fills the GPUs in order, then the CPU, then the disk (Accelerate 1.15's placement).

    Room for the largest layer still to place is kept free on the first GPU (or ``"mps"``) and on the CPU, where
    offloaded layers are brought for their forward. A module that does not fit is split into its parameters and
    children unless its class is in ``no_split_module_classes``; one that cannot be split moves everything after it
    to the next device. Tied parameters are placed with the first module that uses them.

    Args:
        model: the model, typically built under :func:`hasten.init_empty_weights`.
        max_memory: budgets per device (see :func:`~hasten.big_modeling.memory.get_max_memory`; its size strings
            are converted in place); all free memory when None.
        no_split_module_classes: class names never split across devices (e.g. transformer blocks).
        dtype: size floating-point weights as if loaded in this dtype.
        special_dtypes: per-tensor dtypes overriding ``dtype``.
        verbose: print each decision.
        clean_result: merge the entries of a module's parts that landed on one device into one entry.
        offload_buffers: also offload buffers; otherwise the buffers of offloaded modules stay on the GPU, and a
            warning is given when no GPU has room for them.
        fallback_allocation: when the next part does not fit on a device that is still empty, put there the
            first later part that fits (searching depth first) instead of leaving it empty.

    Returns:
        An ``OrderedDict`` ``{name: device}`` (``{"": device}`` when everything lands on one device).
    """
    budgets = get_max_memory(max_memory)
    if isinstance(no_split_module_classes, str):
        no_split_module_classes = [no_split_module_classes]
    no_split = list(no_split_module_classes or [])
    options = {"offload_buffers": offload_buffers, "fallback": fallback_allocation, "verbose": verbose}
    planner = _Planner(model, budgets, no_split, dtype, special_dtypes, options)
    if verbose:
        print(f"Budgets {budgets}; room for the largest layer is kept on {planner.main_devices}.")
    device_map = planner.run()
    if clean_result:
        device_map = clean_device_map(device_map)
    if not offload_buffers:
        _warn_offloaded_buffers(planner, budgets)
    return device_map
