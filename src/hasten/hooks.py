"""``accelerate.hooks``: re-exported from :mod:`hasten.big_modeling.hooks` and :mod:`hasten.big_modeling.hook_attach`,
where they live."""

from .big_modeling.hook_attach import (  # noqa: F401
    attach_align_device_hook,
    attach_align_device_hook_on_blocks,
    attach_execution_device_hook,
    remove_hook_from_submodules,
)
from .big_modeling.hooks import (  # noqa: F401
    AlignDevicesHook,
    CpuOffload,
    LayerwiseCastingHook,
    ModelHook,
    SequentialHook,
    UserCpuOffloadHook,
    add_hook_to_module,
    align_module_device,
    has_offloaded_params,
    remove_hook_from_module,
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
