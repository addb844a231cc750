"""``accelerate.utils.launch``'s public names, re-exported lazily from where hasten defines them (see ``_layout``)."""

from ..compat.launch_env import _convert_nargs_to_dict  # noqa: F401  (Accelerate's private helper, used by its tests)
from ._layout import LAYOUT, reexport

__getattr__, __dir__, __all__ = reexport(__name__, LAYOUT["launch"])
