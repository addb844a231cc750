"""The host memory an asynchronous save copies the training state into, so that training goes on at once.

``save_state(async_save=True)`` must not let the next optimizer step change a tensor before the tensor's
bytes are safe. It copies them into a *staging buffer*: one block of host memory (pinned when a tensor
lives on a GPU, so that the device-to-host copies run at full speed and asynchronously), allocated by the
first asynchronous save and reused by the next ones (it grows only when the state grows). Copies of GPU
tensors are queued on the current stream in ``save_state`` itself, so later kernels (the optimizer step)
run after them without any wait; CPU tensors are copied by the background thread, and each optimizer's
next ``step()`` waits only until that copy is done (a memory copy, a fraction of the write). The files
are then written, checksummed, fsynced and published from the staging buffer while training goes on.

The buffer costs as much host memory as the tensors it holds: the model's parameters and the optimizer's
state (1.21 GB for a 100M-parameter model with AdamW). :func:`staging_memory` says how much is held, and
the first allocation (and each growth) is logged. Where memory is short, ``ProjectConfiguration(
async_staging_limit=...)`` bounds it: whole files are staged, in write order, while they fit; the other
files are written straight from the live tensors first, with the next optimizer step held until they are
written (0 stages nothing: each optimizer step after a save waits for the live tensors' files).
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

import torch

from ..settings.sizes import format_bytes

_ALIGN = 64  # every staged tensor starts at a multiple of this (any dtype's alignment)
_logger = logging.getLogger(__name__)


class _Buffer:
    """The staging memory, kept between saves."""

    def __init__(self):
        self.memory: torch.Tensor | None = None

    def reserve(self, nbytes: int, pinned: bool) -> torch.Tensor:
        """At least ``nbytes`` of staging memory (pinned if asked); allocated only when the kept block is too small."""
        memory = self.memory
        if memory is None or memory.numel() < nbytes or (pinned and not memory.is_pinned()):
            self.memory = memory = None  # the old block goes before the new one is allocated
            self.memory = memory = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
            _logger.info(
                "hasten: asynchronous saves stage the state in %s of %shost memory (kept for the next saves; "
                "ProjectConfiguration(async_staging_limit=...) bounds it)",
                format_bytes(nbytes),
                "pinned " if pinned else "",
            )
        return memory

    def release(self) -> None:
        self.memory = None


_buffer = _Buffer()


def staging_memory() -> int:
    """Bytes of host memory that asynchronous saves keep for staging (0 before the first one and after
    ``end_training``)."""
    return 0 if _buffer.memory is None else _buffer.memory.numel()


def release_staging_memory() -> None:
    """Free the staging buffer (``end_training``); the next asynchronous save allocates it again."""
    _buffer.release()


def copy_bytes(destination: torch.Tensor, source: torch.Tensor) -> None:
    """Copy ``source`` into ``destination`` (same dtype and shape, contiguous) on this thread alone.

    A background thread must not copy with ``Tensor.copy_``: a large copy runs on an OpenMP team that the
    thread starts at once, at the normal priority, and keeps afterwards. On 2 cores that team ran beside
    training's own threads: the saving step and the next 3 lost 0.11-0.18 of a synchronous save, 0.014-0.020
    with this copy (bench/README.md). ``ctypes.memmove`` releases the GIL and runs on the calling thread only; a source
    that is not contiguous, or a lazily conjugated or negated view (rare for parameters and optimizer state), still
    goes through ``copy_``.
    """
    if not source.numel():
        return
    if source.is_contiguous() and not source.is_conj() and not source.is_neg():  # else the bytes are not the values
        ctypes.memmove(destination.data_ptr(), source.data_ptr(), _nbytes(source))
    else:
        destination.copy_(source)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _padded(tensor: torch.Tensor) -> int:
    return -(-_nbytes(tensor) // _ALIGN) * _ALIGN


class Stager:
    """The tensors of one asynchronous save that must be copied before training changes them.

    ``add`` registers each file's tensors that are live (parameters and optimizer state, which only
    ``optimizer.step()`` changes) and its other GPU tensors; :meth:`stage` picks the files that fit the limit,
    reserves the buffer and queues the GPU copies; :meth:`copy` (background) copies the CPU ones.
    """

    def __init__(self):
        self._files: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self._views: dict[int, torch.Tensor] = {}
        self._cpu: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._copied: Any = None  # a CUDA event after the device-to-host copies
        self.staged_bytes = 0

    def add(self, name: str, live: list[torch.Tensor], volatile: list[torch.Tensor]) -> None:
        """Register file ``name``'s tensors that need staging: ``live`` ones (staged if the file fits the limit,
        else written under the step gate) and ``volatile`` ones (GPU tensors that may change at any time, such
        as buffers: always staged, whatever the limit)."""
        if live or volatile:
            self._files[name] = (live, volatile)

    def stage(self, limit: int | None) -> None:
        """Choose the files to stage (all of them without a ``limit``), reserve the memory and queue GPU copies."""
        chosen, total = [], 0
        for live, volatile in self._files.values():
            size = sum(_padded(t) for t in live)
            if limit is None or total + size <= limit:
                chosen += live
                total += size
            chosen += volatile
            total += sum(_padded(t) for t in volatile)
        if not chosen:
            return
        pinned = any(t.device.type == "cuda" for t in chosen)
        memory = _buffer.reserve(total, pinned)
        offset = 0
        for tensor in chosen:
            view = memory[offset : offset + _nbytes(tensor)].view(tensor.dtype).view(tensor.shape)
            offset += _padded(tensor)
            self._views[id(tensor)] = view
            if tensor.device.type == "cpu":
                self._cpu.append((view, tensor))
            else:
                view.copy_(tensor, non_blocking=True)  # queued on the current stream, before any later kernel
        if pinned:
            self._copied = torch.cuda.Event()
            self._copied.record()
        self.staged_bytes = total

    def is_staged(self, name: str) -> bool:
        """True when file ``name`` holds no live tensor that is not staged (it may be written after the gate opens)."""
        return all(id(tensor) in self._views for tensor in self._files.get(name, ([], []))[0])

    def copy(self) -> None:
        """Copy the staged CPU tensors into the buffer (background thread; training waits for this in its next step)."""
        with torch.no_grad():
            for view, tensor in self._cpu:
                copy_bytes(view, tensor.detach())

    def wait_for_device(self) -> None:
        """Wait until the queued device-to-host copies are done (before the staged bytes are written)."""
        if self._copied is not None:
            self._copied.synchronize()

    def resolve(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``tensors`` with each staged tensor replaced by its copy in the buffer."""
        return {key: self._views.get(id(value), value) for key, value in tensors.items()}
