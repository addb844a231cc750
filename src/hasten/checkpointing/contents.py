"""What a checkpoint holds: the objects the ``Accelerator`` hands to ``save_state``/``load_state``, and what they
give a save (the save hooks' weights, the process's random states).

A checkpoint folder holds, besides the manifest:

* what the strategy writes for the models and optimizers (``model.safetensors``, ``optimizer.*``,
  ``model_1.safetensors``, ... or an engine's sharded files);
* ``scheduler.*``, ``scaler.*`` and ``custom_checkpoint_<i>.*`` (JSON structure + safetensors tensors);
* ``dataloaders.json``: each prepared dataloader's epoch, position in samples of the epoch's global order and
  the random states its epoch started from (``load_state`` restores the position only with
  ``DataLoaderConfiguration(use_stateful_dataloader=True)``, as Accelerate does; otherwise the epoch and
  those states, so that a loop skipping its first batches resumes exactly);
* ``random_states_<rank>.*``: every process's python / numpy / torch / CUDA generator states.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..errors import ConfigError
from ..runtime.rng import capture_rng_states


@dataclass
class CheckpointContents:
    """The objects a checkpoint saves and restores (built by the ``Accelerator``)."""

    strategy: Any
    models: list = field(default_factory=list)
    optimizers: list = field(default_factory=list)
    schedulers: list = field(default_factory=list)
    dataloaders: list = field(default_factory=list)
    custom_objects: list = field(default_factory=list)
    scaler: Any = None
    step: int = 0
    save_hooks: list[Callable] = field(default_factory=list)
    load_hooks: list[Callable] = field(default_factory=list)
    restore_dataloader_positions: bool = False

    def counts(self, models: int) -> dict[str, int]:
        """How many objects of each kind a checkpoint of these contents holds (``models``: those left to save or
        load after the hooks)."""
        return {
            "models": models,
            "optimizers": len(self.optimizers),
            "schedulers": len(self.schedulers),
            "dataloaders": len(self.dataloaders),
            "custom_objects": len(self.custom_objects),
        }

    def live_memory(self) -> frozenset[int]:
        """The memory of the parameters and the optimizer state, which only ``optimizer.step()`` changes: an
        asynchronous save stages it (or writes it, under ``async_staging_limit``) before the next step may run."""
        tensors = [p for model in self.models for p in model.parameters()]
        tensors += [
            value
            for optimizer in self.optimizers
            for state in optimizer.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor)
        ]
        return frozenset(t.data_ptr() for t in tensors)

    def torch_optimizers(self) -> list:
        """The torch optimizers inside hasten's wrappers (their step hooks run on every real step)."""
        return [getattr(optimizer, "optimizer", optimizer) for optimizer in self.optimizers]


def check_checkpointable(objects) -> None:
    """Raise ``ConfigError`` for objects lacking ``state_dict`` / ``load_state_dict``."""
    bad = [
        f"Item at index {i}, `{type(obj).__name__}`"
        for i, obj in enumerate(objects)
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)))
    ]
    if bad:
        raise ConfigError(
            "register_for_checkpointing needs objects with state_dict() and load_state_dict(); these have not: "
            f"{'; '.join(bad)}. Wrap the object in a class that defines both."
        )


def suffix(index: int) -> str:
    """The file-name suffix of the ``index``-th object of a kind (``""``, ``"_1"``, ...)."""
    return "" if index == 0 else f"_{index}"


def rng_states() -> dict:
    """This process's random number generator states, as a checkpoint stores them."""
    meta, tensors = capture_rng_states()
    return {"meta": meta, "tensors": tensors}


def run_save_hooks(contents: CheckpointContents, folder: Path) -> list[dict] | None:
    """Run ``register_save_state_pre_hook`` hooks on ``folder``; returns the weights they left to save (None: no
    hooks, or the engine writes the weights).

    Hooks get ``(models, weights, output_dir)``; ``weights`` are the models' state dicts, which a hook may
    change or remove (e.g. after saving the model in its own format). What is left is written by the caller.
    Under a sharded engine (DeepSpeed, FSDP) the engine writes the weights and ``weights`` is empty.
    """
    if not contents.save_hooks:
        return None
    if not contents.strategy.saves_full_state_dicts:
        for hook in contents.save_hooks:  # the engine writes the weights; hooks can add files beside them
            hook(list(contents.models), [], str(folder))
        return None
    models = list(contents.models)
    weights = [contents.strategy.get_state_dict(model) for model in models]
    for hook in contents.save_hooks:
        hook(models, weights, str(folder))
    return weights
