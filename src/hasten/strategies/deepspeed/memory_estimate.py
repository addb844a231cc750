"""How much memory DeepSpeed ZeRO needs per CPU and per GPU, and the advice for a worker killed for memory.

The ZeRO tables follow DeepSpeed's estimators (``estimate_zero3_model_states_mem_needs`` and its
ZeRO-2 sibling): memory for parameters, gradients and Adam states in mixed precision, with a 1.5x
buffer on the CPU side, for each combination of parameter offload, optimizer offload and
partitioned construction (``zero_init``). Activations and CUDA kernels come on top.

``hasten estimate-memory`` prints the table through the DeepSpeed registration (``Engine.memory_table``), after the
engine-neutral per-dtype table of :mod:`hasten.commands.model_size`. Imports neither torch nor DeepSpeed.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import ConfigError

GB = 2**30


@dataclass(frozen=True)
class ZeroRow:
    """One line of the ZeRO table: bytes per CPU and per GPU for one set of options."""

    cpu_bytes: int
    gpu_bytes: int
    offload_param: str
    offload_optimizer: str
    zero_init: int | None

    def format(self) -> str:
        """The line as DeepSpeed prints it (``70.00GB | 0.25GB | offload_param=cpu , ...``)."""
        options = (
            f"offload_param={self.offload_param:<4}, offload_optimizer={self.offload_optimizer:<4}"
            if self.offload_param
            else f"offload_optimizer={self.offload_optimizer:<4}"
        )
        if self.zero_init is not None:
            options += f", zero_init={self.zero_init}"
        return f"{self.cpu_bytes / GB:7.2f}GB | {self.gpu_bytes / GB:7.2f}GB | {options}".rstrip()


def zero3_rows(
    total_params: int,
    largest_layer_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    buffer_factor: float = 1.5,
) -> list[ZeroRow]:
    """ZeRO-3 memory per CPU and per GPU, in the order of DeepSpeed's table (most offload first)."""
    _check_counts(total_params, largest_layer_params, num_gpus_per_node, num_nodes)
    gpus = num_gpus_per_node * num_nodes
    per_node = 1 / num_nodes
    layer = 4 * largest_layer_params
    rows = []
    for offload_param, offload_optimizer in (("cpu", "cpu"), ("none", "cpu"), ("none", "none")):
        for zero_init in (1, 0):
            if offload_optimizer == "cpu":
                factor = 18 if offload_param == "cpu" else 16
                gpu = layer if offload_param == "cpu" else layer + int(2 * total_params / gpus)
                per_param = factor * per_node if zero_init else max(4 * num_gpus_per_node, factor * per_node)
                cpu = total_params * per_param * buffer_factor
            else:
                gpu = layer + int(18 * total_params / gpus)
                cpu = (largest_layer_params if zero_init else total_params) * 4 * num_gpus_per_node * buffer_factor
            rows.append(ZeroRow(int(cpu), int(gpu), offload_param, offload_optimizer, zero_init))
    return rows


def zero2_rows(
    total_params: int, num_gpus_per_node: int = 1, num_nodes: int = 1, buffer_factor: float = 1.5
) -> list[ZeroRow]:
    """ZeRO-2 memory per CPU and per GPU, with and without optimizer offload."""
    _check_counts(total_params, 0, num_gpus_per_node, num_nodes)
    gpus = num_gpus_per_node * num_nodes
    offloaded = ZeroRow(int(total_params * max(4 * gpus, 16) * buffer_factor), 2 * total_params, "", "cpu", None)
    resident = ZeroRow(
        int(total_params * 4 * num_gpus_per_node * buffer_factor),
        2 * total_params + int(18 * total_params / gpus),
        "",
        "none",
        None,
    )
    return [offloaded, resident]


def _check_counts(total: int, largest: int, gpus: int, nodes: int) -> None:
    if total <= 0 or largest < 0 or largest > total:
        raise ConfigError(
            f"Parameter counts must satisfy 0 < largest layer <= total; got total={total}, largest layer={largest}."
        )
    if gpus < 1 or nodes < 1:
        raise ConfigError(f"--num_gpus and --num_nodes must be at least 1; got {gpus} and {nodes}.")


# ------------------------------------------------------------------------------ dtype table


__all__ = ["ZeroRow", "explain_deepspeed_failure", "zero2_rows", "zero3_rows"]


def explain_deepspeed_failure(
    exitcode: int, offload_optimizer_device: str | None = None, offload_param_device: str | None = None
) -> str | None:
    """Advice for a DeepSpeed worker that exited with ``exitcode``, or None when there is none to give.

    A process killed by the operating system (SIGKILL: exit code -9, or 137 from a shell) without a
    traceback usually ran out of CPU memory, most often while DeepSpeed built the model or allocated
    the offloaded optimizer states. ``hasten launch`` prints this next to the failure.
    """
    if exitcode not in (-9, 137):
        return None
    offloads = [
        f"{what}={device}"
        for what, device in (("offload_optimizer", offload_optimizer_device), ("offload_param", offload_param_device))
        if device
    ]
    current = f" (this run: {', '.join(offloads)})" if offloads else ""
    return (
        f"A DeepSpeed process was killed by the operating system (SIGKILL, exit code {exitcode}) without a traceback. "
        "This usually means it tried to use more CPU memory than the machine has: check whether the config offloads "
        f"the optimizer states and/or the parameters to the CPU{current} (zero_optimization.offload_optimizer / "
        "offload_param with device 'cpu'), which keeps them in CPU RAM. Estimate the memory needed with "
        "`hasten estimate-memory MODEL --num_gpus N`, then offload less, use more machines, or under ZeRO-3 offload "
        "to NVMe (device 'nvme' with an nvme_path)."
    )
