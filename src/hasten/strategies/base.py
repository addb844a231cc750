"""The interface every distribution engine implements.

The ``Accelerator`` facade never asks which engine is in use: it calls these methods and the
strategy answers. Implementations live one per file (``single``, ``ddp``, ``fsdp``, ``deepspeed``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Iterable, Mapping

import torch

from ..enums import DistributedType
from ..runtime.compilation import compile_model
from ..runtime.precision import Precision
from ..runtime.weights.offloaded import cpu_state_dict, has_offloaded_weights
from ..state import GradientState, warn_once


@dataclasses.dataclass(frozen=True)
class EngineSettings:
    """What an Accelerator trains with, settled before its state and precision policy are built.

    :func:`hasten.strategies.plan.plan_strategy` builds one from the script's arguments and the launch,
    and the chosen strategy's :meth:`Strategy.resolve` settles it against the engine's own configuration
    (a DeepSpeed config may fix the precision and the accumulation steps).

    Args:
        mixed_precision: ``"no"``, ``"fp16"``, ``"bf16"`` or ``"fp8"``.
        accumulation: the :class:`~hasten.utils.GradientAccumulationPlugin` in force: the one object that
            holds the accumulation settings from the Accelerator's arguments to ``accumulate``/``no_sync``.
        arguments: the engines' ``Accelerator`` arguments by keyword (``deepspeed_plugin``,
            ``parallelism_config``, ...); once planned, the chosen engine's other than its plugin.
        engine: the name of the chosen engine (None until planned).
        plugin: the chosen engine's settings object (``DeepSpeedPlugin``, ``FullyShardedDataParallelPlugin``;
            None for engines without one).
    """

    mixed_precision: str
    accumulation: Any
    arguments: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    engine: str | None = None
    plugin: Any = None


class Strategy(ABC):
    """How models, optimizers and gradients are distributed across processes.

    Args:
        state: the process's ``AcceleratorState``.
        precision: the mixed precision policy.

    :attr:`gradient_state` is the Accelerator's :class:`~hasten.state.GradientState` (whether this step syncs, the
    dataloader being iterated), which :meth:`StrategyPlan.build <hasten.strategies.plan.StrategyPlan.build>` hands to
    every strategy it builds, whatever its engine's :meth:`build` does; a strategy never looks it up.
    """

    distributed_type: ClassVar[DistributedType]
    gradient_state: GradientState

    def __init__(self, state, precision: Precision):
        self.state = state
        self.precision = precision

    @classmethod
    def resolve(cls, settings: EngineSettings) -> EngineSettings:
        """Settle ``settings`` against this engine's own configuration, before any state is built.

        The Accelerator builds its ``AcceleratorState``, ``GradientState`` and ``Precision`` from the
        result, so what the engine decides is in place from the start. The default keeps everything.
        """
        return settings

    @classmethod
    def build(cls, state, precision: Precision, settings: EngineSettings, ddp_kwargs=None) -> Strategy:
        """This strategy for ``state`` and ``precision``, with what it needs of the settled ``settings``."""
        return cls(state, precision)

    @property
    def device(self) -> torch.device:
        """The device of this process."""
        return self.state.device

    @property
    def data_parallel_world(self) -> tuple[int, int]:
        """(number of data-parallel ranks, this process's rank among them): how dataloaders are sharded."""
        return self.state.num_processes, self.state.process_index

    # ---------------------------------------------------------------------------------- preparing

    def prepare(
        self, models: list, optimizers: list, schedulers: list, device_placement: list[bool], dataloaders: list
    ) -> tuple[list, list, list]:
        """Set up the models, optimizers and schedulers of one ``prepare`` call.

        Engines that need everything at once (DeepSpeed) override this; the default sets up each model
        with :meth:`setup_model` and rebinds optimizers with :meth:`setup_optimizer`.
        """
        originals = list(models)
        models = [self.setup_model(m, place) for m, place in zip(models, device_placement)]
        optimizers = [self.setup_optimizer(opt, originals, models) for opt in optimizers]
        return models, optimizers, schedulers

    @abstractmethod
    def setup_model(
        self, model: torch.nn.Module, device_placement: bool = True, evaluation_mode: bool = False
    ) -> torch.nn.Module:
        """Place ``model`` on the device, apply the precision policy and wrap it for the engine."""

    def setup_optimizer(
        self, optimizer: torch.optim.Optimizer, originals: list, prepared: list
    ) -> torch.optim.Optimizer:
        """Return the optimizer to wrap; engines that replace parameters rebind it here."""
        return optimizer

    def compile_model(self, model: torch.nn.Module, dynamo_plugin) -> torch.nn.Module:
        """Compile a model :meth:`prepare` or :meth:`setup_model` returned, as ``dynamo_plugin`` (a
        :class:`~hasten.utils.TorchDynamoPlugin`, or None) says: ``torch.compile``'s wrapper around it, or its regions
        compiled in place (:func:`hasten.runtime.compilation.compile_model`). Engines that compile elsewhere or with
        other settings override this."""
        return compile_model(model, dynamo_plugin)

    # ---------------------------------------------------------------------------------- training

    def backward(self, loss: torch.Tensor, accumulation_steps: int = 1, **kwargs) -> None:
        """Backpropagate ``loss``, divided by ``accumulation_steps`` and scaled for fp16."""
        if accumulation_steps > 1:
            loss = loss / accumulation_steps
        self.precision.backward(loss, **kwargs)

    def no_sync(self, model: torch.nn.Module):
        """Context manager in which backward passes do not reduce gradients across processes."""
        return contextlib.nullcontext()

    def sync_in_backward(self, model: torch.nn.Module):
        """Context manager forcing the gradient reduction of the next backward inside :meth:`no_sync`."""
        return contextlib.nullcontext()

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """Clip gradients to a global norm of ``max_norm`` and return the norm before clipping."""
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def clip_grad_value_(self, parameters: Iterable[torch.Tensor], clip_value: float) -> None:
        """Clamp every gradient to ``[-clip_value, clip_value]``."""
        torch.nn.utils.clip_grad_value_(parameters, clip_value)

    @property
    def scaler(self):
        """The gradient scaler used for fp16 (None when the engine scales the loss itself, or without fp16)."""
        return self.precision.scaler

    @property
    def handles_optimizer_step(self) -> bool:
        """True when the engine steps and zeroes the optimizer itself.

        Then ``AcceleratedOptimizer.step`` calls :meth:`optimizer_step` and reads :attr:`step_was_skipped`,
        and ``zero_grad`` is left to the engine.
        """
        return False

    def optimizer_step(self, optimizer, closure=None):
        """Step the engine's optimizer (only called when :attr:`handles_optimizer_step`)."""
        raise NotImplementedError(f"{type(self).__name__} does not step optimizers itself")

    @property
    def step_was_skipped(self) -> bool:
        """Whether the engine skipped the last optimizer step (fp16 overflow)."""
        return False

    def sequence_parallel_loader(self, loader, model: torch.nn.Module | None = None):
        """``loader`` (prepared) adapted to this strategy's sequence parallelism: each batch's sequences split over the
        ``sp`` ranks, for ``model`` (the prepared model it feeds). Without sequence parallelism, ``loader`` itself."""
        return loader

    def context_parallel(self, buffers=None, buffer_seq_dims=None, no_restore_buffers=None):
        """The context manager of ``accelerator.maybe_context_parallel``: ring attention over the ``cp`` ranks where the
        engine runs context parallelism (FSDP2 on CUDA); elsewhere nothing, with Accelerate's warning once."""
        warn_once(
            "context-parallel-off",
            "Context parallel training is not enabled. This context manager will have no effect. To enable it, set "
            "`parallelism_config.cp_size` > 1 in the `Accelerator` constructor (FSDP2 on CUDA).",
        )
        return contextlib.nullcontext()

    def gather_for_metrics(self, input_data, use_gather_object: bool = False):
        """Gather evaluation outputs from the data-parallel ranks, without the samples padded in at the end."""
        from ..data_loader import gather_for_metrics

        return gather_for_metrics(input_data, self.gradient_state, use_gather_object=use_gather_object)

    @property
    def replicates_model(self) -> bool:
        """True when every process holds the whole model (one device, DDP), so that ``LocalSGD`` can average it;
        sharded engines (the default) answer False."""
        return False

    @property
    def joins_uneven_inputs(self) -> bool | None:
        """How ``join_uneven_inputs`` works: True under DDP (torch's ``Join`` shadows the collectives of ranks that ran
        out of batches), None with nothing to join (one process), False where it has no effect (a warning says so)."""
        return False

    # ---------------------------------------------------------------------------------- unwrapping

    def unwrap_model(
        self, model: torch.nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True
    ) -> torch.nn.Module:
        """The user's model without the engine's, compile's and (optionally) precision's wrappers."""
        from ..runtime.wrappers import extract_model_from_parallel

        return extract_model_from_parallel(
            model, keep_fp32_wrapper=keep_fp32_wrapper, keep_torch_compile=keep_torch_compile
        )

    def tracked_model(self, prepared: torch.nn.Module) -> torch.nn.Module:
        """What ``Accelerator._models`` holds for a model this engine prepared (what save/load-state hooks get).

        As in Accelerate: the user's module itself (without DDP's and compile's wrappers; a mixed precision
        forward stays), which hooks can call ``save_pretrained`` on. Engines whose wrapper is what Accelerate
        keeps (DeepSpeed's engine, FSDP) return ``prepared``.
        """
        return self.unwrap_model(prepared, keep_fp32_wrapper=True, keep_torch_compile=False)

    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The full state dict of ``model`` (gathered when sharded), on the CPU where the engine allows.

        The model itself is left as it is (its mixed precision forward stays in place).
        """
        target = self.unwrap_model(model, keep_fp32_wrapper=True, keep_torch_compile=False) if unwrap else model
        if has_offloaded_weights(target):
            return cpu_state_dict(target)
        return target.state_dict()

    # ---------------------------------------------------------------------------------- checkpoints

    @property
    def saves_full_state_dicts(self) -> bool:
        """True when checkpoints store each model as one full state dict (what save-state hooks may edit).

        Sharded engines answer False: their files are written by the engine and hooks cannot change them.
        """
        return True

    @property
    def save_needs_every_process(self) -> bool:
        """True when every process writes part of a checkpoint (sharded engines), so ``save_state`` must run on all.

        Replicated engines answer False: the main process holds everything, so a save the main process
        makes alone (``if accelerator.is_main_process: accelerator.save_state(...)``) works too.
        """
        return False

    def save_checkpoint(self, writer, models: list, optimizers: list) -> None:
        """Write the state of the prepared models and optimizers into a checkpoint being written.

        ``writer`` is a :class:`hasten.checkpointing.CheckpointWriter`. By default the writing process
        stores each model's full state dict (``model.safetensors``, ``model_1.safetensors``, ...) and each
        optimizer's state (``optimizer.*``, ``optimizer_1.*``); sharded engines override this to write
        per-rank files and register them with ``writer.track``.
        """
        for i, model in enumerate(models):
            state_dict = self.get_state_dict(model)
            if writer.is_main:
                writer.save_tensors(f"model{_suffix(i)}.safetensors", state_dict)
        for i, optimizer in enumerate(optimizers):
            if writer.is_main:
                writer.save_state(f"optimizer{_suffix(i)}", optimizer.state_dict())

    def load_checkpoint(self, reader, models: list, optimizers: list) -> None:
        """Restore what :meth:`save_checkpoint` wrote (``reader`` is a ``CheckpointReader``).

        Every model and optimizer is checked against the checkpoint before any is changed; tensors are
        then read straight into the live ones where shape and dtype match. A checkpoint that another engine saved
        (DeepSpeed ZeRO's files, FSDP2's shards or full state dict) is restored by parameter name
        (:mod:`~hasten.strategies.engine_change`).
        """
        from ..checkpointing.live_load import check_model, check_optimizer, load_model, load_optimizer
        from .engine_change import resume_saved_by_another_engine

        if resume_saved_by_another_engine(self, reader, models, optimizers):  # e.g. ZeRO's or FSDP2's
            return
        targets = [self.unwrap_model(model, keep_fp32_wrapper=True, keep_torch_compile=False) for model in models]
        for i, target in enumerate(targets):
            check_model(reader, f"model{_suffix(i)}.safetensors", target)
        for i, optimizer in enumerate(optimizers):
            check_optimizer(reader, f"optimizer{_suffix(i)}", optimizer)
        for i, target in enumerate(targets):
            load_model(reader, f"model{_suffix(i)}.safetensors", target)
        for i, optimizer in enumerate(optimizers):
            load_optimizer(reader, f"optimizer{_suffix(i)}", optimizer)


def _suffix(index: int) -> str:
    return "" if index == 0 else f"_{index}"
