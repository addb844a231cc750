"""``accelerate.hooks``: re-exported from :mod:`hasten.big_modeling.hooks`, where it lives."""

from .big_modeling.hooks import (  # noqa: F401
    ModelHook,
    LayerwiseCastingHook,
    SequentialHook,
    add_hook_to_module,
    remove_hook_from_module,
    remove_hook_from_submodules,
    AlignDevicesHook,
    CpuOffload,
    UserCpuOffloadHook,
    attach_execution_device_hook,
    attach_align_device_hook,
    attach_align_device_hook_on_blocks,
    has_offloaded_params,
    align_module_device,
)

__all__ = [
    "ModelHook",
    "LayerwiseCastingHook",
    "SequentialHook",
    "add_hook_to_module",
    "remove_hook_from_module",
    "remove_hook_from_submodules",
    "AlignDevicesHook",
    "CpuOffload",
    "UserCpuOffloadHook",
    "attach_execution_device_hook",
    "attach_align_device_hook",
    "attach_align_device_hook_on_blocks",
    "has_offloaded_params",
    "align_module_device",
]
