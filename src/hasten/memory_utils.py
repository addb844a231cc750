"""``accelerate.memory_utils``: Accelerate's old home of the memory helpers, kept for old imports.

Importing it warns, as Accelerate does; the helpers live in :mod:`hasten.runtime.memory` (``hasten.utils.memory``).
"""

import warnings

from .runtime.memory import find_executable_batch_size, release_memory, should_reduce_batch_size  # noqa: F401

warnings.warn(
    "hasten.memory_utils is the old path of the memory helpers; import find_executable_batch_size from hasten "
    "(`from hasten import find_executable_batch_size`) or from hasten.utils.memory to avoid this warning.",
    FutureWarning,
    stacklevel=2,
)
