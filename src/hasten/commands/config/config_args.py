"""``accelerate.commands.config.config_args``: the launch config classes and their loader, where Accelerate has them.

hasten defines them in :mod:`hasten.config`; this module gives them under Accelerate's path.
"""

from ...config import BaseConfig, ClusterConfig, SageMakerConfig
from . import default_config_file, load_config_from_file

default_json_config_file = default_yaml_config_file = default_config_file

__all__ = [
    "BaseConfig",
    "ClusterConfig",
    "SageMakerConfig",
    "default_config_file",
    "default_json_config_file",
    "default_yaml_config_file",
    "load_config_from_file",
]
