"""The ``Accelerator``'s checkpoint methods, mixed into the facade: what to save, and the calls into this package.

They read the facade's prepared objects (``_models``, ``_optimizers``, ...), its strategy and its project
configuration, and hand them, with the facade's ``state``, to :func:`save_state`/:func:`load_state` of this package,
which do the work and look no process-wide state up.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..state import warn_once


def _warn_ignored(method: str, **groups: dict) -> None:
    """Warn (once) about Accelerate keyword arguments that hasten's checkpoint format has no use for."""
    given = {name: sorted(values) for name, values in groups.items() if values}
    if given:
        warn_once(
            f"{method}-ignored-kwargs",
            f"{method}() ignores {given}: hasten writes and reads checkpoints itself (safetensors + JSON, no "
            "torch.save/torch.load, strict loading), so these Accelerate options do not apply.",
        )


class CheckpointingMethods:
    """``save_state``, ``load_state``, checkpoint hooks and model saving of :class:`~hasten.Accelerator`."""

    def _checkpoint_contents(self):
        from . import CheckpointContents

        return CheckpointContents(
            strategy=self._strategy,
            models=self._models,
            optimizers=self._optimizers,
            schedulers=self._schedulers,
            dataloaders=self._dataloaders,
            custom_objects=self._custom_objects,
            scaler=self.scaler,
            step=self.step,
            save_hooks=list(self._save_hooks.values()),
            load_hooks=list(self._load_hooks.values()),
            restore_dataloader_positions=self.dataloader_config.use_stateful_dataloader,
        )

    def save_state(
        self,
        output_dir: str | None = None,
        safe_serialization: bool = True,
        async_save: bool | None = None,
        **save_model_func_kwargs,
    ) -> str:
        """Save models, optimizers, schedulers, the fp16 scaler, dataloader positions, RNG states and registered
        objects.

        The folder appears complete or not at all (written under a temporary name, fsynced, manifest last,
        renamed). With ``ProjectConfiguration(automatic_checkpoint_naming=True)``, ``output_dir`` defaults to
        ``<project_dir>/checkpoints/checkpoint_<i>`` and old checkpoints beyond ``total_limit`` are deleted once
        the new one is complete. Call it on every process. Returns the checkpoint's path.

        hasten checkpoints hold no pickles (safetensors + JSON); ``safe_serialization=False`` and Accelerate's
        ``save_model_func_kwargs`` are ignored, with a warning.

        ``async_save=True`` (default: ``ProjectConfiguration(async_save=...)``) copies the state to CPU memory and
        returns; the files are written and published in the background. The next ``save_state``, ``load_state`` and
        ``end_training()`` wait for it and raise its error, if any (docs/checkpointing.md).
        """
        from . import save_state

        _warn_ignored("save_state", save_model_func_kwargs=save_model_func_kwargs)
        return str(
            save_state(
                self._checkpoint_contents(),
                self.project_configuration,
                self.state,
                output_dir,
                safe_serialization,
                async_save,
            )
        )

    def load_state(
        self, input_dir: str | None = None, load_kwargs: dict | None = None, **load_model_func_kwargs
    ) -> str:
        """Restore everything :meth:`save_state` wrote, verifying the checkpoint first.

        ``input_dir`` defaults to the latest complete automatic checkpoint (interrupted saves are ignored
        and reported). Prepared dataloaders get their saved epoch and random start back; their position inside
        the epoch only with ``DataLoaderConfiguration(use_stateful_dataloader=True)``, as in Accelerate
        (otherwise skip the trained batches yourself: :meth:`skip_first_batches`, or ``continue``). Raises
        :class:`~hasten.errors.CheckpointError` naming any missing or corrupt file. Returns the path loaded.
        Accelerate's ``load_kwargs`` / ``load_model_func_kwargs`` (``torch.load`` / ``load_state_dict`` options) do
        not apply to hasten's format and are ignored, with a warning.
        """
        from . import load_state

        _warn_ignored("load_state", load_kwargs=load_kwargs or {}, load_model_func_kwargs=load_model_func_kwargs)
        path, self.step = load_state(self._checkpoint_contents(), self.project_configuration, self.state, input_dir)
        return str(path)

    def register_for_checkpointing(self, *objects) -> None:
        """Include objects with ``state_dict()``/``load_state_dict()`` in :meth:`save_state`/:meth:`load_state`."""
        from . import check_checkpointable

        check_checkpointable(objects)
        self._custom_objects.extend(objects)

    def register_save_state_pre_hook(self, hook: Callable):
        """Call ``hook(models, weights, output_dir)`` before :meth:`save_state` writes models.

        ``weights`` are the models' state dicts; the hook may change or remove them (e.g. after saving a model
        in its own format), and hasten writes what is left. Returns a handle with ``remove()``.
        """
        from torch.utils.hooks import RemovableHandle

        handle = RemovableHandle(self._save_hooks)
        self._save_hooks[handle.id] = hook
        return handle

    def register_load_state_pre_hook(self, hook: Callable):
        """Call ``hook(models, input_dir)`` before :meth:`load_state`; models it removes from the list are not
        loaded."""
        from torch.utils.hooks import RemovableHandle

        handle = RemovableHandle(self._load_hooks)
        self._load_hooks[handle.id] = hook
        return handle

    @property
    def save_iteration(self) -> int:
        """Number of the next automatic checkpoint."""
        return self.project_configuration.iteration

    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict:
        """The full state dict of a prepared model (gathered when sharded). Call it on every process."""
        return self._strategy.get_state_dict(model, unwrap=unwrap)

    def save_model(
        self,
        model: torch.nn.Module,
        save_directory: str,
        max_shard_size: int | str = "10GB",
        safe_serialization: bool = True,
    ) -> None:
        """Save a prepared model's weights as ``model.safetensors`` (or shards + index) in ``save_directory``.

        Tied weights are stored once. Call it on every process (sharded engines gather the weights); the
        main process writes.
        """
        from ..runtime.weights.saving import save_model_weights

        state_dict = self.get_state_dict(model)
        if self.is_main_process:
            save_model_weights(
                state_dict, save_directory, max_shard_size=max_shard_size, safe_serialization=safe_serialization
            )

    def save(self, obj, f, safe_serialization: bool = False) -> None:
        """Save ``obj`` to ``f`` once per job (once per machine with ``save_on_each_node``).

        A dict of tensors with ``safe_serialization=True`` is written as safetensors, anything else with ``torch.save``.
        """
        from ..runtime.weights.saving import save

        save(
            obj,
            f,
            save_on_each_node=self.project_configuration.save_on_each_node,
            safe_serialization=safe_serialization,
        )
