"""The random state an epoch of a prepared loader starts from, kept so that a resumed epoch can replay it.

Starting an epoch draws from streams the user's script draws from too: the ``DataLoader`` iterator draws
its workers' base seed (from the loader's ``generator``, else the global torch generator) and a shuffling
sampler draws its order (a plain ``RandomSampler`` seeds itself from the global generator, others use
their ``generator``). hasten draws exactly what Accelerate draws. To resume an epoch in the middle with
the same order, and without moving the global generator away from the state the checkpoint restored, a
prepared loader copies those generators' states when an epoch starts (no draw), saves them with its
position (``rng`` in its state), and a resumed epoch starts from them: the global generator's state is put
back once the first batch is fetched, the loader's and the sampler's generators go on from where the
replay leaves them.

Saved between two epochs, a loader keeps its own generators' current states (not the global one's: the
checkpoint restores that, and the next epoch draws from it as the uninterrupted run does), so that the
epochs after a resume shuffle as the uninterrupted run's do.

An epoch resumed on another number of processes is drawn as the saving run drew it: Accelerate gives a
shuffling sampler without a generator one of its own only on several processes, so the replay lends the
sampler the saved generator state (saved on several, resumed on one) or has it draw from the global
generator (saved on one, resumed on several) for that epoch's start.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import torch

from .sharding import SeedableRandomSampler, get_sampler


def _sampler_generator(loader) -> torch.Generator | None:
    generator = getattr(get_sampler(loader), "generator", None)
    return generator if isinstance(generator, torch.Generator) else None


def _encode(state: torch.Tensor | None) -> str | None:
    return None if state is None else base64.b64encode(state.numpy().tobytes()).decode("ascii")


def _decode(text: str | None) -> torch.Tensor | None:
    return None if text is None else torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


@dataclass(frozen=True)
class EpochStart:
    """States of the global torch generator, the loader's ``generator`` and its sampler's ``generator``
    at the start of an epoch (None where the loader has no such generator; no global state between epochs)."""

    torch_state: torch.Tensor | None
    loader_state: torch.Tensor | None = None
    sampler_state: torch.Tensor | None = None

    @classmethod
    def capture(cls, loader, with_global: bool = True) -> EpochStart:
        """Copy the states (nothing is drawn); ``with_global=False`` leaves the global generator out."""
        generator, sampler_generator = getattr(loader, "generator", None), _sampler_generator(loader)
        return cls(
            torch.get_rng_state() if with_global else None,
            generator.get_state() if isinstance(generator, torch.Generator) else None,
            sampler_generator.get_state() if sampler_generator is not None else None,
        )

    def to_json(self) -> dict[str, str | None]:
        """JSON-compatible form, for a checkpoint's ``dataloaders.json``."""
        return {
            "torch": _encode(self.torch_state),
            "loader": _encode(self.loader_state),
            "sampler": _encode(self.sampler_state),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> EpochStart:
        """The inverse of :meth:`to_json`."""
        return cls(_decode(data["torch"]), _decode(data.get("loader")), _decode(data.get("sampler")))

    @contextlib.contextmanager
    def replayed(self, loader) -> Iterator[None]:
        """Start the loader's generators from these states; the global generator's current state comes back on exit
        (without a global state, the global generator is left alone)."""
        current = None
        if self.torch_state is not None:
            current = torch.get_rng_state()
            torch.set_rng_state(self.torch_state)
        generator = getattr(loader, "generator", None)
        if self.loader_state is not None and isinstance(generator, torch.Generator):
            generator.set_state(self.loader_state)
        sampler = get_sampler(loader)
        own = getattr(sampler, "generator", None)
        drawing = self._order_generator(sampler, own)
        if drawing is not own:
            sampler.generator = drawing
        try:
            yield
        finally:
            if drawing is not own:
                sampler.generator = own
            if current is not None:
                torch.set_rng_state(current)

    def _order_generator(self, sampler, own) -> torch.Generator | None:
        """The generator the sampler draws the replayed epoch's order from: its own (or, when it has none, a loan)
        at the saved state; or none, so that it draws from the global generator as the saving run's sampler did
        (an epoch saved in its middle whose sampler had no generator)."""
        if self.sampler_state is not None and hasattr(sampler, "generator"):
            drawing = own if isinstance(own, torch.Generator) else torch.Generator()
            drawing.set_state(self.sampler_state)
            return drawing
        if self.torch_state is not None and isinstance(own, torch.Generator):
            return own if isinstance(sampler, SeedableRandomSampler) else None
        return own


def draw_iterator_seed(loader) -> None:
    """Draw what ``iter(loader)`` draws without loading anything: its workers' base seed (once with persistent
    workers), then, with workers, what the sampler draws for the index batches the workers are sent at once
    (``prefetch_factor`` per worker). A process that does not read the data draws it too, as under Accelerate,
    which creates the iterator on every process."""
    first = True
    if loader.persistent_workers and loader.num_workers > 0:  # the iterator is created once and then reset
        first = not getattr(loader, "_iterator_seed_drawn", False)
        loader._iterator_seed_drawn = True
    if first:
        torch.empty((), dtype=torch.int64).random_(generator=loader.generator)
    if loader.num_workers > 0:
        requests = (loader.prefetch_factor or 2) * loader.num_workers
        for _ in itertools.islice(iter(loader._index_sampler), requests):
            pass
