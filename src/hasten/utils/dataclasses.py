"""``accelerate.utils.dataclasses``'s public names, re-exported lazily from where hasten defines them (see
``_layout``)."""

from ._layout import LAYOUT, reexport

__getattr__, __dir__, __all__ = reexport(__name__, LAYOUT["dataclasses"])
