"""Memory budgets for device maps: size strings, the budgets per device, and budgets balanced over GPUs.

Budgets are ``{device: bytes}`` with GPU indices as ints and ``"mps"``, ``"cpu"``, ``"disk"`` as strings. They
follow Accelerate 1.15 exactly, including what callers rely on: :func:`get_max_memory` converts the size strings
of the caller's own dict in place (transformers reads that dict again afterwards).
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping

import torch
from torch import nn

from ..errors import ConfigError, did_you_mean
from .modeling import compute_module_sizes

logger = logging.getLogger(__name__)

_NAMED_DEVICES = ("mps", "cpu", "disk")
# (suffix, bytes per unit) checked in this order, as Accelerate does: the binary units first, then the decimal ones,
# where a lowercase "b" at the very end means bits.
_BINARY_UNITS = (("GIB", 2**30), ("MIB", 2**20), ("KIB", 2**10))
_DECIMAL_UNITS = (("GB", 10**9), ("MB", 10**6), ("KB", 10**3))


class SizeError(ConfigError):
    """A size that is not a number of bytes nor a number followed by a unit."""


def _invalid_size(size) -> SizeError:
    return SizeError(
        f"Invalid size {size!r}: expected a number of bytes (an int) or a number followed by a unit: KiB, MiB, GiB "
        "(powers of 1024), KB, MB, GB (powers of 1000; a lowercase final 'b' means bits, e.g. '10Mb'), as in '10GB' or "
        "'1.5GiB'."
    )


def convert_file_size_to_int(size: int | str) -> int:
    """Bytes in a size such as ``"5MB"``, ``"1.5GiB"`` or ``"10Gb"`` (bits); an int is returned as it is.

    The accepted forms are Accelerate's: a number (anything ``float()`` reads) followed by ``KiB``/``MiB``/``GiB``
    or ``KB``/``MB``/``GB`` in any case, where a lowercase final ``b`` means bits. A bare number in a string, ``TB``
    and negative sizes are refused.

    Raises:
        SizeError: (a ``ValueError``) the size is malformed or negative.
    """
    if isinstance(size, int):
        if size < 0:
            raise _invalid_size(size)
        return size
    upper = size.upper()
    try:
        for suffix, factor in _BINARY_UNITS:
            if upper.endswith(suffix):
                return _non_negative(int(float(size[: -len(suffix)]) * factor), size)
        for suffix, factor in _DECIMAL_UNITS:
            if upper.endswith(suffix):
                count = int(float(size[:-2]) * factor)
                return _non_negative(count // 8 if size.endswith("b") else count, size)
    except ValueError:
        raise _invalid_size(size) from None
    raise _invalid_size(size)


def _non_negative(count: int, size: str) -> int:
    if count < 0:
        raise _invalid_size(size)
    return count


def _free_memory() -> dict:
    """Free memory of every accelerator that answers, then the available RAM (MPS shares RAM: no CPU entry then)."""
    import psutil

    from ..environment import accelerator_type, device_count

    memory: dict = {}
    kind = accelerator_type()
    integrated = False
    if kind in ("cuda", "xpu"):
        backend = getattr(torch, kind)
        for index in range(device_count(kind)):
            try:
                memory[index] = backend.mem_get_info(index)[0]
            except RuntimeError:
                logger.info("Device %s does not answer; leaving it out of the memory budgets.", index)
                continue
            if kind == "cuda":
                integrated = integrated or bool(
                    getattr(torch.cuda.get_device_properties(index), "is_integrated", False)
                )
    if kind == "mps":
        memory["mps"] = psutil.virtual_memory().available
    elif not integrated:
        memory["cpu"] = psutil.virtual_memory().available
    return memory


def _visible_accelerators() -> int:
    from ..environment import accelerator_type, device_count

    kind = accelerator_type()
    return device_count(kind) if kind in ("cuda", "xpu") else 0


def get_max_memory(max_memory: MutableMapping | None = None) -> dict:
    """Memory budgets per device, in bytes, ordered GPUs (by index), then ``"mps"``, ``"cpu"``, ``"disk"``.

    Args:
        max_memory: ``{device: size}``, sizes as ints or strings (``"10GiB"``, ``"500MB"``). Its strings are
            converted to ints in place, as Accelerate does. When None, the free memory of every visible
            accelerator and the available RAM.

    Raises:
        ConfigError: (a ``ValueError``) a key is not a device (GPU indices are ints: ``0``, not ``"cuda:0"``) or a
            size is malformed.
    """
    if max_memory is None:
        return _free_memory()
    for key, value in max_memory.items():
        if isinstance(value, str):
            max_memory[key] = convert_file_size_to_int(value)
    gpus = sorted(key for key in max_memory if isinstance(key, int))
    visible = _visible_accelerators()
    for index in gpus:
        if not 0 <= index < visible:
            logger.warning("Device %s is not available, available devices are %s", index, list(range(visible)))
    order = gpus + [name for name in _NAMED_DEVICES if name in max_memory]
    for key in max_memory:
        if key not in order:
            raise ConfigError(
                f"max_memory key {key!r} is not a device: use GPU indices as ints (0, 1, ...), 'mps', 'cpu' or 'disk', "
                f"e.g. max_memory={{0: '10GiB', 'cpu': '30GiB'}}.{did_you_mean(str(key), _NAMED_DEVICES)}"
            )
    return {key: max_memory[key] for key in order}


def _counts_as_accelerator(key) -> bool:
    if isinstance(key, int):
        return True
    from ..environment import accelerator_type

    kind = accelerator_type()
    return key == (kind if kind != "cpu" else "cuda")


def _no_split_names(no_split_module_classes) -> list[str]:
    if no_split_module_classes is None:
        return []
    if isinstance(no_split_module_classes, str):
        return [no_split_module_classes]
    return list(no_split_module_classes)


def _largest_no_split_block(model: nn.Module, sizes: dict, no_split: list[str]):
    """The size of the first block found (in ``sizes`` order) of each no-split class; the largest of them, or 0."""
    found: dict = {}
    for name, size in sizes.items():
        if not name:
            continue
        target = model
        for part in name.split("."):
            target = getattr(target, part)
        cls = type(target).__name__
        if cls in no_split and cls not in found:
            found[cls] = size
        if set(found) == set(no_split):
            break
    return max(found.values()) if found else 0


def _leaves(sizes) -> list[str]:
    parents = {name.rsplit(".", 1)[0] for name in sizes if "." in name}
    return [name for name in sizes if name and name not in parents]


def _mean_block_size(sizes: dict) -> int:
    """The mean size of the modules that hold tensors directly and no submodule with tensors."""
    tensors = set(_leaves(sizes))
    modules = {name: size for name, size in sizes.items() if name not in tensors}
    blocks = _leaves(modules)
    return int(sum(modules[name] for name in blocks) / max(len(blocks), 1))


def get_balanced_memory(
    model: nn.Module,
    max_memory: MutableMapping | None = None,
    no_split_module_classes: list[str] | None = None,
    dtype: str | torch.dtype | None = None,
    special_dtypes: dict | None = None,
    low_zero: bool = False,
) -> dict:
    """Budgets that make :func:`~hasten.big_modeling.device_map.infer_auto_device_map` spread ``model`` over the GPUs.

    Every GPU but the last gets the model's size divided by the number of GPUs with memory, plus a margin of 1.25
    times the larger of the first no-split block found and the mean size of the innermost modules; the last GPU
    keeps its whole budget. With ``low_zero``, GPU 0 gets only what does not fit on the others (generation uses
    it). With one GPU and no ``max_memory``, 90% of its free memory is used. Without GPUs the budgets are
    :func:`get_max_memory`'s. Accelerate 1.15's rules, including its rounding.

    Args:
        model: the model (on the meta device is fine).
        max_memory: budgets per device (its size strings are converted in place); all free memory when None.
        no_split_module_classes: class names never split across devices.
        dtype: size floating-point weights as if loaded in this dtype.
        special_dtypes: per-tensor dtypes overriding ``dtype``.
        low_zero: keep GPU 0 as empty as possible.
    """
    measured = max_memory is None
    budgets = get_max_memory(max_memory)
    gpu_count = len([key for key in budgets if key != "disk" and _counts_as_accelerator(key) and budgets[key] > 0])
    if gpu_count == 0:
        return budgets
    if gpu_count == 1:
        low_zero = False
        if measured:
            first = next((key for key in budgets if isinstance(key, int)), None)
            if first is not None:
                budgets[first] *= 0.9
                logger.info("Using 90%% of the memory of device %s for the model and keeping 10%% free.", first)
    sizes = compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes)
    per_gpu = sizes[""] // (gpu_count - 1 if low_zero else gpu_count)
    margin = max(
        _largest_no_split_block(model, sizes, _no_split_names(no_split_module_classes)), _mean_block_size(sizes)
    )
    per_gpu += int(1.25 * margin)
    gpus = sorted(key for key, size in budgets.items() if isinstance(key, int) and size > 0)
    for index in gpus[:-1]:
        budgets[index] = min(budgets[0] if low_zero and index == 0 else per_gpu, budgets[index])
    if low_zero:
        rest = sum(budgets[index] for index in range(1, gpu_count))
        budgets[0] = min(max(0, sizes[""] - rest), budgets[0])
    return budgets
