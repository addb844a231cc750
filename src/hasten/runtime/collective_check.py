"""Every hasten collective first checks, in every mode, that all processes are about to run the same thing.

The check is one all-gather (the *exchange*) whose size every process knows beforehand: ``room`` bytes of
payload followed by a fixed header of four integers (the collective's number, a code of the operation's name, a
digest of what must agree across processes for that operation: its tensors' shapes, dtypes and devices, and
arguments such as ``from_process``; each collective of :mod:`hasten.runtime.operations` says what; and the
number of payload bytes this process wants to send). ``room`` is part of the processes' shared history: it is
set after each exchange from what every process saw in it (the payload size of that collective, rounded up to a
power of two, at most :data:`RIDE_LIMIT`; 0 when it could not travel this way), so it is the same on every
process at every call, and the exchange's size cannot go wrong whatever the processes pass.

A payload that fits in ``room`` travels inside the exchange: in a loop that gathers or reduces data of the same
sizes at every step (metrics, a logged loss) each collective is this one all-gather, as in a raw loop. A payload
that does not fit (the first call, a larger one, a device tensor) travels in a second collective once the headers
agree, in the operation's own form. When the operations or the digests differ, every process sees it in the same
headers, so all of them exchange a readable description of their inputs and raise the same
:class:`~hasten.errors.DistributedOperationException`, naming the operation and each process's collective number,
shapes and dtypes; whatever payload came with the headers is dropped. Without the check, gloo aborts one process
and returns a wrong tensor on the other (shapes), or returns wrong numbers on every process (dtypes).

With a CPU-only backend (gloo) the exchange travels over the default group; with NCCL or another device backend
it travels, with the header only, over a gloo group created beside it on the first collective, so the check never
waits for the device, and the payload then moves on the device.
"""

from __future__ import annotations

import functools
import hashlib
import weakref
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..errors import DistributedOperationException

_HEADER = 4  # collective number, operation code, digest, payload bytes (-1: this process's payload cannot ride)
_HEADER_BYTES = _HEADER * 8
RIDE_LIMIT = 64 * 1024  # bytes: larger payloads travel in a collective of their own (padding costs more than a trip)
# all-gather into one flat tensor: torch 2.13 renamed it (the old name warns); torch 2.6 has only the old one
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_buffers: dict[tuple[int, int], tuple] = {}  # (world, room) -> the send and gathered buffers, with numpy views


@functools.lru_cache(maxsize=None)
def operation_code(name: str) -> int:
    """The same integer for ``name`` on every process (Python's ``hash`` of a string differs between processes)."""
    return zlib.crc32(name.encode())


def digest(key) -> int:
    """A 64-bit digest of ``key`` (its ``repr``), the same on every process."""
    return int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "little", signed=True)


class _Channel:
    """What every check of the current default group reads: the processes' number and rank, the group the
    exchange travels over, whether CPU payloads ride in it, and the room agreed for the next exchange. Read once
    per default group, not per call; rebuilt when the default group is (OOM recovery), with the room back at 0."""

    def __init__(self, world):
        # Held weakly: a strong reference kept a destroyed group alive, and a process forked after that (the debug
        # launcher's workers) destroyed its copy of the parent's gloo group when it replaced this view:
        # std::system_error or SIGSEGV in the child, before its first collective.
        self.world = weakref.ref(world)
        self.size, self.rank = dist.get_world_size(), dist.get_rank()
        self.rides = "gloo" in str(dist.get_backend())
        self.side = None  # the gloo group beside a device backend, created at the first exchange
        self.room = 0


_channel: _Channel | None = None


def channel() -> _Channel:
    """The checks' view of the current default group (it must exist)."""
    global _channel
    world = dist.group.WORLD
    if _channel is None or _channel.world() is not world:
        _channel = _Channel(world)
    return _channel


def header_group():
    """The group the headers travel over: the default one when it moves CPU tensors, else a gloo group beside it
    (created on first use, a collective of every process)."""
    found = channel()
    if found.rides:
        return found.world()
    if found.side is None:
        found.side = dist.new_group(backend="gloo")
    return found.side


def payloads_ride() -> bool:
    """Whether CPU payloads can travel inside the exchange (the default group moves CPU tensors)."""
    return channel().rides


@dataclass(frozen=True)
class Exchanged:
    """What one exchange established: every process agreed (or, for a lenient check, ``agreed`` says whether)."""

    agreed: bool
    sizes: tuple[int, ...]  # each process's payload bytes (-1: it had none that could ride)
    rows: torch.Tensor | None  # (processes, room) bytes holding each one's payload, when every one rode; valid until
    # the next exchange

    def part(self, rank: int) -> torch.Tensor:
        """Process ``rank``'s payload bytes (only when every payload rode)."""
        return self.rows[rank, : self.sizes[rank]]


def exchange(
    name: str,
    seq: int,
    agree: Callable,
    args: tuple,
    kwargs: dict,
    size: int = -1,
    fill: Callable[[torch.Tensor], None] | None = None,
    lenient: bool = False,
) -> Exchanged:
    """Run the exchange of collective ``name`` (number ``seq``); raise on every process when they disagree.

    Args:
        agree: ``agree(*args, **kwargs)`` returns what must be equal across processes for this operation.
        size: the bytes of this process's payload, or -1 when it has none that can ride (it is on a device, or
            the exchange goes over a side group).
        fill: ``fill(buffer)`` writes the payload into the CPU ``uint8`` tensor ``buffer`` of ``size`` bytes;
            called only when the payload fits in the exchange.
        lenient: when the operations agree but the digests do not, return ``agreed=False`` instead of raising
            (``gather_for_metrics`` then takes its path for processes with different shapes).
    """
    try:
        key = agree(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 - a bad call still takes part, so that every process learns of it
        key = ("cannot describe the inputs", type(error).__name__, str(error))
    group, state = header_group(), channel()
    world, room = state.size, state.room
    send, mine, gathered, payloads, headers = _exchange_buffers(world, room)
    if 0 < size <= room:
        fill(send[:size])
    mine[:] = (seq, operation_code(name), digest(key), size)
    all_gather_flat(gathered, send, group=group)
    rows = headers.tolist()
    sizes = tuple(row[3] for row in rows)
    state.room = _next_room(sizes)
    if any(row[1] != rows[0][1] for row in rows) or (not lenient and any(row[2] != rows[0][2] for row in rows)):
        _raise_mismatch(name, seq, args, kwargs, group, world)
    if any(row[2] != rows[0][2] for row in rows):
        return Exchanged(False, sizes, None)
    return Exchanged(True, sizes, payloads if all(0 <= s <= room for s in sizes) else None)


def _next_room(sizes: tuple[int, ...]) -> int:
    """The room of the next exchange: this one's largest payload rounded up to a power of two (at least 16
    bytes, so that every process's payload starts where any dtype may be viewed), or 0 when a process had no
    payload that could ride or it was too large."""
    largest = max(sizes)
    if min(sizes) < 0 or largest > RIDE_LIMIT or largest == 0:
        return 0
    return max(16, 1 << (largest - 1).bit_length())


def _exchange_buffers(world: int, room: int) -> tuple:
    """Reused buffers (the exchange is synchronous) with numpy views of the headers: filling and comparing them
    costs about a microsecond, where building tensors costs several."""
    found = _buffers.get((world, room))
    if found is None:
        stride = room + _HEADER_BYTES
        send, gathered = torch.zeros(stride, dtype=torch.uint8), torch.empty(world * stride, dtype=torch.uint8)
        mine = send[room:].view(torch.int64).numpy()
        every = gathered.view(world, stride)
        headers = every[:, room:].view(torch.int64).numpy()
        found = _buffers[(world, room)] = (send, mine, gathered, every[:, :room], headers)
    return found


def _raise_mismatch(name: str, seq: int, args: tuple, kwargs: dict, group, world: int) -> None:
    description = (name, seq, describe(args[0]) if args else "(no inputs)", _arguments(args, kwargs))
    everyone: list = [None] * world
    dist.all_gather_object(everyone, description, group=group)
    raise DistributedOperationException(_mismatch_message(name, everyone))


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
