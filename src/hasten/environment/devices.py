"""The devices of this machine and the one this process uses."""

from __future__ import annotations

from ..errors import DistributedSetupError
from .variables import get_str


def accelerator_type() -> str:
    """The accelerator family present: ``"cuda"``, ``"xpu"``, ``"mps"`` or ``"cpu"``."""
    import torch

    if torch.cuda.is_available():
        return "cuda"
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return "xpu"
    if hasattr(torch.backends, "mps") and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def device_count(kind: str) -> int:
    """Number of devices of family ``kind`` visible to this process."""
    import torch

    if kind == "cuda":
        return torch.cuda.device_count()
    if kind == "xpu":
        return torch.xpu.device_count()
    return 1


def select_device(cpu: bool, local_rank: int):
    """The device this process should use: an override, then ``<accelerator>:<local_rank>``, then CPU."""
    import torch

    override = get_str("TORCH_DEVICE")
    if override:
        return torch.device(override)
    kind = "cpu" if cpu else accelerator_type()
    if kind in ("cuda", "xpu"):
        count = device_count(kind)
        if local_rank >= count:
            raise DistributedSetupError(
                f"This process has local rank {local_rank} but only {count} {kind.upper()} device(s) are visible. "
                f"Start at most {count} process(es) per machine (--num_processes), or check CUDA_VISIBLE_DEVICES / "
                "--gpu_ids."
            )
        return torch.device(kind, local_rank)
    return torch.device(kind)
