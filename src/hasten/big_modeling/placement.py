"""Reading and tidying device maps: the device a tensor gets, whether a map covers a model, merged entries.

A device map is a dict ``{module_or_tensor_name: device}`` where ``device`` is a GPU index, ``"cpu"``, ``"disk"``
(or another device); ``{"": 0}`` puts the whole model on GPU 0. A tensor's device is the value of the longest name
in the map that is a prefix of the tensor's name.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping

from torch import nn

from ..errors import ConfigError, did_you_mean

logger = logging.getLogger(__name__)


def device_for(name: str, device_map: Mapping):
    """The device ``device_map`` gives to tensor ``name`` (longest matching prefix), or None."""
    parts = name.split(".")
    for depth in range(len(parts), -1, -1):
        prefix = ".".join(parts[:depth])
        if prefix in device_map:
            return device_map[prefix]
    return None


def check_device_map(model: nn.Module, device_map: Mapping) -> None:
    """Check that ``device_map`` gives a device to every tensor of ``model``'s state dict.

    Entries that name no submodule (a typo, or a tensor name) draw a ``UserWarning``, as in Accelerate; they
    still place the tensors they name.

    Raises:
        ConfigError: (a ``ValueError``) some tensors of the state dict have no device (listed).
    """
    modules = dict(model.named_modules())
    unknown = [name for name in device_map if name != "" and name not in modules]
    if unknown:
        hints = "".join(did_you_mean(name, [n for n in modules if n]) for name in unknown[:3])
        warnings.warn(
            f"The following device_map keys do not match any submodules in the model: {unknown}.{hints}",
            UserWarning,
            stacklevel=2,
        )
    if "" in device_map:
        return
    uncovered = [
        name
        for name in model.state_dict()
        if not any(name == entry or name.startswith(entry + ".") for entry in device_map)
    ]
    if uncovered:
        shown = ", ".join(uncovered[:10]) + (f" and {len(uncovered) - 10} more" if len(uncovered) > 10 else "")
        raise ConfigError(
            f"The device_map gives no device to these tensors: {shown}. Add entries for them (or for their modules), "
            'use {"": device} for the whole model, or let hasten compute one with device_map="auto".'
        )


def clean_device_map(device_map: dict, module_name: str = "") -> dict:
    """Collapse the entries under ``module_name`` into one entry for it when they all share one device, recursively.

    Works on the names alone (no model needed): ``{"a.0": 0, "a.1": 0, "b": "cpu"}`` becomes
    ``{"b": "cpu", "a": 0}``. A merged entry moves to the end of the map, and the submodules are visited in the
    order of a set of their names (so the order of the result follows ``PYTHONHASHSEED``), exactly as in Accelerate.
    ``device_map`` is changed in place and returned.

    Args:
        device_map: ``{name: device}``.
        module_name: the module whose entries are collapsed (``""``: the whole model).
    """
    prefix = f"{module_name}." if module_name else ""
    under = [name for name in device_map if name.startswith(prefix)]
    devices = [device_map[name] for name in under]
    if len(devices) > 1 and len(set(devices)) == 1:
        for name in under:
            del device_map[name]
        device_map[module_name] = devices[0]
    depth = len(module_name.split(".")) + 1 if module_name else 1
    children = {
        ".".join(name.split(".")[:depth])
        for name in device_map
        if name.startswith(prefix) and len(name) > len(module_name)
    }
    for child in children:
        clean_device_map(device_map, child)
    return device_map


def _placed_device(name: str, device_map: Mapping):
    """The entry of ``name`` or of its closest module in ``device_map`` (``""`` last)."""
    probe = name
    while probe not in device_map:
        if probe == "":
            raise ConfigError(f"The device_map places neither {name!r} nor any module holding it.")
        probe = ".".join(probe.split(".")[:-1])
    return device_map[probe]


def check_tied_parameters_on_same_device(tied_params: list[list[str]], device_map: Mapping) -> None:
    """Log a warning for each group of tied parameters that ``device_map`` spreads over several devices.

    Raises:
        ConfigError: (a ``ValueError``) a tied parameter gets no device from ``device_map``.
    """
    for group in tied_params:
        devices = {name: _placed_device(name, device_map) for name in group}
        if len(set(devices.values())) > 1:
            logger.warning(
                "Tied parameters are on different devices: %s. Keep them together in the device_map or use "
                "device_map='auto'.",
                devices,
            )
