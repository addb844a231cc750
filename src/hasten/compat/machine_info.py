"""What this machine and process are: devices, GPU names and driver, CPU placement, loaded libraries.

The helpers of ``accelerate.utils.environment`` that describe the machine. None of them initialises a GPU
context (safe before ``fork``), and none reads launch settings (those live in :mod:`hasten.environment`).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from .. import environment
from ..settings.launch import DEBUG


@dataclass
class CPUInformation:
    """Where this process sits in a CPU job: global rank and size, rank and size on this machine."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1


def get_cpu_distributed_information() -> CPUInformation:
    """Rank and sizes of this process as its launcher (torchrun, MPI or Slurm) told it; 0/1 when not launched."""
    info = environment.detect_launch()
    return CPUInformation(
        rank=info.rank, world_size=info.world_size, local_rank=info.local_rank, local_world_size=info.local_world_size
    )


def are_libraries_initialized(*library_names: str) -> list[str]:
    """The names among ``library_names`` that are already imported in this process."""
    return [name for name in library_names if name in sys.modules]


def get_current_device_type() -> tuple[str, str]:
    """``(device type, distributed type)`` of the accelerators here, without initialising any of them:
    ``("xpu", "MULTI_XPU")`` on Intel GPUs, otherwise ``("cuda", "MULTI_GPU")``."""
    import torch

    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return "xpu", "MULTI_XPU"
    return "cuda", "MULTI_GPU"


def _nvidia_smi(query: str) -> list[str]:
    executable = shutil.which("nvidia-smi")
    if executable is None:
        return []
    try:
        output = subprocess.run(
            [executable, f"--query-gpu={query}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (subprocess.SubprocessError, OSError):
        return []
    return [line.strip() for line in output.splitlines() if line.strip()]


def get_gpu_info() -> tuple[list[str], int]:
    """The names of the NVIDIA GPUs here and their number (``([], 0)`` without ``nvidia-smi``)."""
    names = _nvidia_smi("name")
    return names, len(names)


def get_driver_version() -> str | None:
    """The NVIDIA driver version, or ``None`` without ``nvidia-smi``."""
    versions = _nvidia_smi("driver_version")
    return versions[0] if versions else None


def check_cuda_p2p_ib_support() -> bool:
    """False for RTX 4000-series GPUs under a driver older than 550, whose peer-to-peer and InfiniBand paths
    hang NCCL (set ``NCCL_P2P_DISABLE=1`` and ``NCCL_IB_DISABLE=1`` there); True otherwise."""
    names, count = get_gpu_info()
    driver = get_driver_version()
    if count > 1 and driver is not None and any("RTX 40" in name for name in names):
        return int(driver.split(".")[0]) >= 550
    return True


def check_cuda_fp8_capability() -> bool:
    """A CUDA GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell) is present."""
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def _parse_cpu_list(text: str) -> list[int]:
    cpus: list[int] = []
    for part in text.strip().split(","):
        if "-" in part:
            first, last = part.split("-")
            cpus.extend(range(int(first), int(last) + 1))
        elif part:
            cpus.append(int(part))
    return cpus


def _gpu_local_cpus(index: int) -> list[int] | None:
    import torch

    properties = torch.cuda.get_device_properties(index)
    bus = getattr(properties, "pci_bus_id", None)
    if bus is None:
        return None
    address = f"{getattr(properties, 'pci_domain_id', 0):04x}:{bus:02x}:{getattr(properties, 'pci_device_id', 0):02x}.0"
    cpulist = Path("/sys/bus/pci/devices") / address / "local_cpulist"
    return _parse_cpu_list(cpulist.read_text()) if cpulist.is_file() else None


def override_numa_affinity(local_process_index: int, verbose: bool | None = None) -> None:
    """Pin this process to the CPUs of the NUMA node of GPU ``local_process_index`` (Linux, CUDA).

    Does nothing without CUDA or where the GPU's node cannot be read. ``verbose`` (default: hasten's debug
    mode) prints the CPUs chosen.
    """
    import torch

    if not torch.cuda.is_available() or not hasattr(os, "sched_setaffinity"):
        return
    cpus = _gpu_local_cpus(local_process_index)
    if not cpus:
        return
    os.sched_setaffinity(0, cpus)
    if verbose if verbose is not None else environment.launch_setting(DEBUG):
        print(f"hasten: process {local_process_index} pinned to CPUs {cpus} (NUMA node of GPU {local_process_index}).")


@functools.cache
def set_numa_affinity(local_process_index: int, verbose: bool | None = None) -> None:
    """:func:`override_numa_affinity`, done once per process and GPU index."""
    override_numa_affinity(local_process_index, verbose=verbose)
