"""Several tensors as the bytes of one buffer, so that one collective moves them all (and the collectives' check).

A :class:`Packing` lays the tensors out one after the other, each starting at a multiple of 16 bytes (where any
dtype may be viewed), fills a ``uint8`` buffer with their bytes and reads tensors back from another process's
buffer of the same layout. Nothing here talks to other processes (:mod:`hasten.runtime.operations` does).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass

import torch

ALIGN = 16  # bytes: every tensor starts where any dtype may be viewed


def fusable(leaves: list[torch.Tensor]) -> bool:
    """Plain dense tensors on one device (not subclasses such as DTensor, not sparse or quantized ones)."""
    device = leaves[0].device
    plain = (torch.Tensor, torch.nn.Parameter)
    return all(
        type(t) in plain and t.device == device and t.layout == torch.strided and not t.is_quantized for t in leaves
    )


@dataclass(frozen=True)
class Packing:
    """Where each of some tensors lies in one byte buffer (0-dimensional tensors travel as 1-dimensional ones)."""

    flat: tuple[torch.Tensor, ...]
    offsets: tuple[int, ...]
    total: int

    @classmethod
    def of(cls, leaves: list[torch.Tensor]) -> Packing:
        """The layout of ``leaves`` (their bytes as they are: contiguous, conjugation and negation resolved)."""
        flat = tuple((t[None] if t.ndim == 0 else t).detach().resolve_conj().resolve_neg().contiguous() for t in leaves)
        offsets, total = [], 0
        for t in flat:
            offsets.append(total)
            total += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
        return cls(flat, tuple(offsets), total)

    def fill(self, buffer: torch.Tensor) -> None:
        """Write every tensor's bytes into ``buffer`` (``uint8``, at least :attr:`total` bytes, on their device)."""
        for t, offset in zip(self.flat, self.offsets):
            size = t.numel() * t.element_size()
            buffer[offset : offset + size] = t.reshape(-1).view(torch.uint8)

    def packed(self) -> torch.Tensor:
        """A new buffer holding every tensor's bytes."""
        buffer = torch.empty(self.total, dtype=torch.uint8, device=self.flat[0].device)
        self.fill(buffer)
        return buffer

    def read(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """The tensors laid out in ``buffer`` (views of it), with the shapes and dtypes of this packing's."""
        return [
            buffer[offset : offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            for t, offset in zip(self.flat, self.offsets)
        ]

    def stacked(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """Every process's tensors from ``rows`` (one buffer of this layout per process, a 2-dimensional ``uint8``
        tensor whose rows start at multiples of 16 bytes): per tensor a view of shape ``(processes, *shape)``."""
        return [
            rows[:, offset : offset + t.numel() * t.element_size()].view(t.dtype).view(len(rows), *t.shape)
            for t, offset in zip(self.flat, self.offsets)
        ]

    def concatenate(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """Each tensor of every process's buffer in ``rows``, concatenated on the first dimension in process order:
        new tensors (``rows`` may be a buffer that the next collective reuses)."""
        return [
            every.clone(memory_format=torch.contiguous_format).view(-1, *every.shape[2:])
            for every in self.stacked(rows)
        ]


def pickled(obj) -> torch.Tensor:
    """``obj`` pickled into a ``uint8`` tensor."""
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def unpickled(data: torch.Tensor):
    """The object pickled in the ``uint8`` tensor ``data`` (sent by another process of the same job)."""
    return pickle.loads(data.numpy().tobytes())
