"""Where gradient accumulation and the active dataloader stand: :class:`GradientState`, shared by every instance
(``hasten.state`` exports it under Accelerate's path, ``accelerate.state.GradientState``)."""

from __future__ import annotations

import weakref
from typing import Any


class GradientState:
    """Where gradient accumulation and the active dataloader stand, shared by every object that asks.

    ``sync_gradients`` is True on steps where gradients are reduced and the optimizer steps;
    ``end_of_dataloader`` and ``remainder`` describe the batch being processed so that
    ``gather_for_metrics`` can drop samples that were padded in; ``backward_calls`` counts the
    ``accelerator.backward`` calls since the last optimizer step (:meth:`record_backward`,
    :meth:`record_optimizer_step`).
    """

    _shared_state: dict[str, Any] = {}

    def __init__(self, gradient_accumulation_plugin=None):
        self.__dict__ = self._shared_state
        if not self.__dict__.get("initialized"):
            self.sync_gradients = True
            self.active_dataloader = None
            self.dataloader_references: list = [None]
            self.plugin_kwargs: dict[str, Any] = {}
            self.backward_calls = 0
            self.initialized = True
        if gradient_accumulation_plugin is not None:
            # Only the fields that differ from their defaults, as Accelerate keeps them (transformers reads
            # plugin_kwargs); so the default adjust_scheduler=True reads back as False, as in Accelerate.
            self.plugin_kwargs = gradient_accumulation_plugin.to_kwargs()

    @property
    def num_steps(self) -> int:
        """Micro-batches per optimizer step."""
        return self.plugin_kwargs.get("num_steps") or 1

    @property
    def adjust_scheduler(self) -> bool:
        """Whether schedulers count skipped micro-steps (True only when the plugin was given ``adjust_scheduler``
        different from its default, as in Accelerate: in practice, never)."""
        return self.plugin_kwargs.get("adjust_scheduler", False)

    @property
    def sync_with_dataloader(self) -> bool:
        """Whether the last batch of a dataloader always synchronises gradients."""
        return self.plugin_kwargs.get("sync_with_dataloader", True)

    @property
    def sync_each_batch(self) -> bool:
        """Whether gradients are reduced on every micro-batch (saves memory, costs communication)."""
        return self.plugin_kwargs.get("sync_each_batch", False)

    @property
    def in_dataloader(self) -> bool:
        """True while iterating a prepared dataloader."""
        return self.active_dataloader is not None

    @property
    def end_of_dataloader(self) -> bool:
        """True while processing the last batch of the active dataloader."""
        loader = self.active_dataloader
        return bool(loader is not None and loader.end_of_dataloader)

    @property
    def remainder(self) -> int:
        """Real samples in the last global batch of the active dataloader (-1 when unknown)."""
        loader = self.active_dataloader
        return -1 if loader is None else loader.remainder

    @property
    def is_xla_gradients_synced(self) -> bool:
        """Always True: hasten never runs on XLA, whose gradients Accelerate synchronises lazily."""
        return True

    def record_backward(self) -> None:
        """Count one ``accelerator.backward`` call since the last optimizer step (read as :attr:`backward_calls`)."""
        self.backward_calls += 1

    def record_optimizer_step(self) -> None:
        """Start counting backward calls afresh: the prepared optimizer stepped."""
        self.backward_calls = 0

    def _set_sync_gradients(self, sync_gradients: bool) -> None:
        self.sync_gradients = sync_gradients

    def _add_dataloader(self, dataloader) -> None:
        self.active_dataloader = dataloader
        self.dataloader_references.append(dataloader)

    def _remove_dataloader(self, dataloader) -> None:
        if not self.__dict__.get("initialized"):  # the state was reset while an iterator was still alive
            return
        if dataloader in self.dataloader_references:
            self.dataloader_references.remove(dataloader)
        self.active_dataloader = self.dataloader_references[-1]
        self._last_dataloader = weakref.ref(dataloader)

    def __getstate__(self) -> dict:
        """Picklable (``pickle.dumps(accelerator)`` works, as in Accelerate): the weak reference to the last
        dataloader is left out."""
        return {k: v for k, v in self.__dict__.items() if k != "_last_dataloader"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def last_dataloader(self):
        """The prepared dataloader whose iteration ended last (None if none did or it is gone).

        ``gather_for_metrics`` called after a loop uses its layout to return the dataset exactly.
        """
        ref = self.__dict__.get("_last_dataloader")
        return ref() if ref is not None else None

    def __repr__(self) -> str:
        return (
            f"Sync Gradients: {self.sync_gradients}\nAt end of current dataloader: {self.end_of_dataloader}\n"
            f"Extra samples added: {self.remainder}\nGradient accumulation plugin: {self.plugin_kwargs}\n"
        )

    @classmethod
    def _reset_state(cls) -> None:
        """Forget the accumulation state. Prefer :func:`reset_state`."""
        cls._shared_state.clear()
