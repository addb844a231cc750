"""Every hasten collective first checks, in every mode, that all processes are about to run the same thing.

Before its data moves, a collective exchanges a fixed-size header of three integers per process: its
collective number, a code of the operation's name and a digest of what must agree across processes
for that operation (its tensors' shapes, dtypes and devices, and arguments such as ``from_process``;
each collective of :mod:`hasten.runtime.operations` says what). The header's size never depends on the
inputs, so the exchange itself cannot go wrong whatever the processes pass. When the operations or
the digests differ, every process sees it in the same headers, so all of them exchange a readable
description of their inputs and raise the same
:class:`~hasten.errors.DistributedOperationException`, naming the operation and each process's
collective number, shapes and dtypes. Without the header, gloo aborts one process and returns a
wrong tensor on the other (shapes), or returns wrong numbers on every process (dtypes).

The cost is one small all-gather per collective call (none inside DDP's ``backward``, which hasten does
not run). With a CPU-only backend (gloo) the header travels over the default group; with NCCL or
another device backend it travels over a gloo group created beside it on the first collective, so the
check never waits for the device.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..errors import DistributedOperationException

_HEADER = 3  # collective number, operation code, digest
# all-gather into one flat tensor: torch 2.13 renamed it (the old name warns); torch 2.6 has only the old one
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_side_group: dict[str, Any] = {}  # the gloo group for the headers when the default group cannot carry CPU tensors
_buffers: dict[int, tuple] = {}  # world size -> this process's header and the gathered headers, with numpy views


def operation_code(name: str) -> int:
    """The same integer for ``name`` on every process (Python's ``hash`` of a string differs between processes)."""
    return zlib.crc32(name.encode())


def digest(key) -> int:
    """A 64-bit digest of ``key`` (its ``repr``), the same on every process."""
    return int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "little", signed=True)


def header_group():
    """The group the headers travel over: the default one when it moves CPU tensors, else a gloo group beside it."""
    world = dist.group.WORLD
    if "gloo" in str(dist.get_backend()):
        return world
    if _side_group.get("world") is not world:  # first use, or the default group was rebuilt (OOM recovery)
        _side_group.update(world=world, group=dist.new_group(backend="gloo"))
    return _side_group["group"]


def verify(name: str, seq: int, agree: Callable, args: tuple, kwargs: dict) -> None:
    """Exchange the header of collective ``name`` (number ``seq``); raise on every process when they disagree.

    ``agree(*args, **kwargs)`` returns what must be equal across processes for this operation.
    """
    try:
        key = agree(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 - a bad call still takes part, so that every process learns of it
        key = ("cannot describe the inputs", type(error).__name__, str(error))
    group = header_group()
    world = dist.get_world_size()
    header, mine, gathered, rows = _header_buffers(world)
    mine[0], mine[1], mine[2] = seq, operation_code(name), digest(key)
    all_gather_flat(gathered, header, group=group)
    headers = rows.tolist()
    if all(row[1:] == headers[0][1:] for row in headers):
        return
    description = (name, seq, describe(args[0]) if args else "(no inputs)", _arguments(args, kwargs))
    everyone: list = [None] * world
    dist.all_gather_object(everyone, description, group=group)
    raise DistributedOperationException(_mismatch_message(name, everyone))


def _header_buffers(world: int) -> tuple:
    """Reused header tensors (the exchange is synchronous) with numpy views: filling and comparing them costs
    about a microsecond, where building tensors costs several."""
    found = _buffers.get(world)
    if found is None:
        header, gathered = torch.empty(_HEADER, dtype=torch.int64), torch.empty(world * _HEADER, dtype=torch.int64)
        found = _buffers[world] = (header, header.numpy(), gathered, gathered.numpy().reshape(world, _HEADER))
    return found


def _arguments(args: tuple, kwargs: dict) -> str:
    shown = [repr(a) for a in args[1:] if _simple(a)]
    shown += [f"{k}={v!r}" for k, v in kwargs.items() if _simple(v)]
    return ", ".join(shown)


def _simple(value) -> bool:
    if isinstance(value, (list, tuple)):
        return all(isinstance(item, int) for item in value)
    return isinstance(value, (int, float, str, bool))


def _mismatch_message(name: str, everyone: list) -> str:
    if len({entry[0] for entry in everyone}) > 1:
        calls = "\n".join(f"  - Process {i}: `{e[0]}` (collective #{e[1]})" for i, e in enumerate(everyone))
        return (
            "Cannot apply desired operation: the processes called different collectives. Every process must call the "
            f"same collectives in the same order.\n\nOperation: `hasten.runtime.operations.{name}`\nCalls:\n{calls}\n"
            "A process that leaves a loop early (a shorter dataloader, a `break` on some processes) or calls a "
            "collective under `if accelerator.is_main_process:` causes this."
        )
    inputs = "\n".join(
        f"  - Process {i}: {e[2]}{f' ({e[3]})' if e[3] else ''} (collective #{e[1]})" for i, e in enumerate(everyone)
    )
    return (
        "Cannot apply desired operation: the processes passed mismatched inputs (shapes, dtypes or arguments).\n\n"
        f"Operation: `hasten.runtime.operations.{name}`\nInput shapes:\n{inputs}\n{_REQUIREMENTS.get(name, _GENERIC)}"
    )


_GENERIC = "Every process must pass tensors of the same shapes and dtypes."
_REQUIREMENTS = {
    "gather": "gather needs the same shape and dtype on every process; "
    "pad_across_processes first evens out one dimension.",
    "reduce": "reduce needs the same shapes, dtypes and reduction on every process.",
    "broadcast": "broadcast needs tensors of the sender's shapes and dtypes on every process, "
    "and the same from_process.",
    "pad_across_processes": "pad_across_processes needs the same structure, number of dimensions "
    "and dim on every process.",
    "broadcast_object_list": "broadcast_object_list needs a list of the same length "
    "and the same from_process on every process.",
    "gather_with_sizes": "gather_for_metrics needs tensors with the same dtype "
    "and trailing dimensions on every process.",
}


# ------------------------------------------------------------------------------ what must agree


def _leaf_key(tensor: torch.Tensor) -> tuple:
    return (tuple(tensor.shape), tensor.dtype, tensor.device.type)


def _structure_key(data, leaf: Callable) -> Any:
    if isinstance(data, torch.Tensor):
        return leaf(data)
    if isinstance(data, (list, tuple)):
        return tuple(_structure_key(item, leaf) for item in data)
    if isinstance(data, Mapping):
        return tuple((_plain(k), _structure_key(v, leaf)) for k, v in data.items())
    return type(data).__name__


def _plain(key) -> Any:
    return key if isinstance(key, (str, int, float, bool)) or key is None else type(key).__name__


def same_tensors(data) -> Any:
    """Structure, shapes, dtypes and device types: what gather, reduce and broadcast need equal everywhere."""
    if isinstance(data, torch.Tensor):  # the common case, without the walk
        return (tuple(data.shape), data.dtype, data.device.type)
    return _structure_key(data, _leaf_key)


def same_ranks(data) -> Any:
    """Structure and numbers of dimensions: what pad_across_processes needs equal everywhere."""
    return _structure_key(data, lambda t: t.ndim)


def same_trailing(data, first_dims: Callable[[torch.Tensor], Any]) -> Any:
    """Structure, dtypes, device types and every dimension but the first, with ``first_dims(leaf)`` for the first."""
    return _structure_key(data, lambda t: (tuple(t.shape[1:]), t.dtype, t.device.type, first_dims(t)))


def describe(data) -> str:
    """Shapes and dtypes of ``data`` for a message: ``[2, 3] float32``, or the structure holding them."""
    if isinstance(data, torch.Tensor):
        device = "" if data.device.type == "cpu" else f" on {data.device.type}"
        return f"{list(data.shape)} {str(data.dtype).removeprefix('torch.')}{device}"
    if isinstance(data, (list, tuple)):
        inner = ", ".join(describe(item) for item in data)
        return f"[{inner}]" if isinstance(data, list) else f"({inner})"
    if isinstance(data, Mapping):
        return "{" + ", ".join(f"{k!r}: {describe(v)}" for k, v in data.items()) + "}"
    return type(data).__name__
