"""The operating system: the Linux kernel and the warning about kernels where distributed jobs hang."""

from __future__ import annotations

import platform
import re

from ..accelerate_alias import logger_for


def kernel_version() -> tuple[int, ...] | None:
    """The Linux kernel version as a tuple, or None on other systems."""
    if platform.system() != "Linux":
        return None
    match = re.match(r"(\d+)\.(\d+)", platform.release())
    return (int(match.group(1)), int(match.group(2))) if match else None


_kernel_warned = False


def check_os_kernel() -> None:
    """Log a warning once when the Linux kernel is older than 5.5, where processes are known to hang (on
    Accelerate's logger ``accelerate.utils.environment`` under the alias, else ``hasten.utils.environment``)."""
    global _kernel_warned
    version = kernel_version()
    if _kernel_warned or version is None or version >= (5, 5):
        return
    _kernel_warned = True
    logger_for("utils.environment").warning(
        f"Detected Linux kernel {platform.release()}, older than the minimum recommended 5.5.0: distributed jobs "
        "are known to hang on such kernels. Upgrade the kernel if processes stall."
    )
