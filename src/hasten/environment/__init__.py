"""Reads the world: hasten's settings from ``os.environ``, the launcher that started this process, the devices and the
operating system. One module per concern; this package hands their names on under ``hasten.environment``:

- :mod:`.variables`: the only reader of ``os.environ`` for settings (:data:`SETTINGS`, ``HASTEN_<NAME>`` then
  ``ACCELERATE_<NAME>``; :func:`fill_unset` and :func:`launch_setting` read a row's variable), the registered
  :data:`ENGINES`, and Accelerate's helpers that read any variable;
- :mod:`.launch`: the launch environments (torch elastic, MPI, Slurm, none), one class each, and
  :func:`detect_launch`;
- :mod:`.devices`: the accelerator family and the device of this process;
- :mod:`.system`: the kernel check;
- :mod:`.folders`: the config folders and the torch extensions folder;
- :mod:`.patching`: Accelerate's helpers that change ``os.environ`` for a while.
"""

from __future__ import annotations

from ..settings.values import str_to_bool
from .devices import accelerator_type, device_count, select_device
from .folders import accelerate_config_home, config_home, default_config_file, torch_extensions_dir
from .launch import (
    DETECTION_ORDER,
    LaunchEnvironment,
    LaunchInfo,
    detect_environment,
    detect_launch,
    export_for_torch,
    parse_slurm_nodelist,
    prepare_rendezvous,
)
from .patching import clear_environment, convert_dict_to_env_variables, patch_environment, purge_accelerate_environment
from .system import check_os_kernel, kernel_version
from .variables import (
    ENGINES,
    SETTINGS,
    any_set,
    fill_unset,
    get_flag,
    get_float,
    get_int,
    get_int_from_env,
    get_str,
    launch_setting,
    parse_choice_from_env,
    parse_flag_from_env,
    read_setting,
    setting_source,
    variable_name,
)

__all__ = [
    "DETECTION_ORDER",
    "ENGINES",
    "SETTINGS",
    "LaunchEnvironment",
    "LaunchInfo",
    "accelerate_config_home",
    "accelerator_type",
    "any_set",
    "check_os_kernel",
    "clear_environment",
    "config_home",
    "convert_dict_to_env_variables",
    "default_config_file",
    "detect_environment",
    "detect_launch",
    "device_count",
    "export_for_torch",
    "fill_unset",
    "get_flag",
    "get_float",
    "get_int",
    "get_int_from_env",
    "get_str",
    "kernel_version",
    "launch_setting",
    "parse_choice_from_env",
    "parse_flag_from_env",
    "parse_slurm_nodelist",
    "patch_environment",
    "prepare_rendezvous",
    "purge_accelerate_environment",
    "read_setting",
    "select_device",
    "setting_source",
    "str_to_bool",
    "torch_extensions_dir",
    "variable_name",
]
