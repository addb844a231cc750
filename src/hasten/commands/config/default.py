"""``accelerate.commands.config.default``: ``write_basic_config`` (``hasten config default``'s file, written from
code)."""

from ...config import write_basic_config
from . import default_config_file

__all__ = ["default_config_file", "write_basic_config"]
