"""Device maps: which module of a model lives on which GPU, on the CPU, or on disk.

A device map is a dict ``{module_or_tensor_name: device}`` where ``device`` is a GPU index, ``"cpu"`` or
``"disk"``; ``{"": 0}`` puts the whole model on GPU 0. This module gathers the device-map API under one path:
budgets (:mod:`~hasten.big_modeling.memory`), the planner (:mod:`~hasten.big_modeling.planner`) and reading and
tidying maps (:mod:`~hasten.big_modeling.placement`). All follow Accelerate 1.15's results.
"""

from __future__ import annotations

from .memory import convert_file_size_to_int, get_balanced_memory, get_max_memory
from .placement import check_device_map, clean_device_map, device_for
from .planner import infer_auto_device_map

DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")

__all__ = [
    "DEVICE_MAP_STRATEGIES",
    "check_device_map",
    "clean_device_map",
    "convert_file_size_to_int",
    "device_for",
    "get_balanced_memory",
    "get_max_memory",
    "infer_auto_device_map",
]
