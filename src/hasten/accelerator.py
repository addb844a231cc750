"""The ``Accelerator``: one object that adapts a PyTorch training script to any setup.

Add four lines to a script::

    accelerator = Accelerator()
    model, optimizer, dataloader, scheduler = accelerator.prepare(model, optimizer, dataloader, scheduler)
    ...
    accelerator.backward(loss)          # instead of loss.backward()

and the same script runs on a CPU, one GPU, many GPUs or many machines, with mixed precision and
gradient accumulation. The facade only delegates: the distribution engine is a ``Strategy``
(``hasten.strategies``), data handling lives in ``hasten.data_loader``, collectives in
``hasten.runtime.operations``.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Callable

import torch

from . import environment
from .checkpointing.facade import CheckpointingMethods
from .compat.accelerator_members import AcceleratorCompatibility, refuse_unsupported_plugins
from .data_loader import DataLoaderStateMixin, skip_first_batches
from .data_loader.facade import DataLoaderSettings
from .data_loader.prepare import Sharing, prepare_loader_for
from .enums import DistributedType, RNGType
from .errors import ConfigError
from .optimizer import AcceleratedOptimizer
from .plugins import (
    AORecipeKwargs,
    AutocastKwargs,
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    FP8RecipeKwargs,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
    ProfileKwargs,
    ProjectConfiguration,
)
from .plugins.dynamo import build_dynamo_plugin
from .plugins.training import resolve_accumulation
from .preparation import PreparationHelpers, _mark_prepared
from .process_control import ProcessControl
from .runtime import operations, preemption
from .runtime.memory import release_memory
from .runtime.precision import Precision
from .scheduler import AcceleratedScheduler
from .state import AcceleratorState, GradientState, PartialState, requested_mixed_precision, warn_once
from .strategies import EngineSettings, plan_strategy
from .tracking.facade import TrackingMethods

_UNSET = object()
_HANDLERS = {
    DistributedDataParallelKwargs: "ddp_handler",
    GradScalerKwargs: "scaler_handler",
    InitProcessGroupKwargs: "init_handler",
    AutocastKwargs: "autocast_handler",
    ProfileKwargs: "profile_handler",
    FP8RecipeKwargs: "fp8_recipe_handler",
    AORecipeKwargs: "ao_recipe_handler",
}


class Accelerator(
    DataLoaderSettings,
    CheckpointingMethods,
    TrackingMethods,
    AcceleratorCompatibility,
    PreparationHelpers,
    ProcessControl,
):
    """Adapts a training script to the current hardware and launch.

    Args:
        device_placement: move prepared models and batches to :attr:`device`.
        split_batches: the dataloader's batch size is the global one, split between processes
            (hasten honours this argument; Accelerate 1.15 ignores it). Same as
            ``DataLoaderConfiguration(split_batches=True)``.
        mixed_precision: ``"no"``, ``"fp16"``, ``"bf16"`` or ``"fp8"`` (default: ``HASTEN_MIXED_PRECISION`` or
            ``"no"``).
        gradient_accumulation_steps: micro-batches per optimizer step, used with :meth:`accumulate`.
        cpu: run on the CPU even when an accelerator is present.
        dataloader_config: a :class:`~hasten.DataLoaderConfiguration`.
        rng_types: generators synchronised at each epoch start (default ``["generator"]``).
        log_with: tracker name(s) or ``GeneralTracker`` instance(s), ``"all"`` for every installed one.
        project_dir: base folder for logs and automatic checkpoints.
        project_config: a :class:`~hasten.utils.ProjectConfiguration`.
        gradient_accumulation_plugin: a :class:`~hasten.utils.GradientAccumulationPlugin`.
        step_scheduler_with_optimizer: step prepared schedulers only with real optimizer steps.
        kwargs_handlers: handlers customising DDP, the fp16 scaler, the process group, autocast, the profiler, fp8.
        deepspeed_plugin, fsdp_plugin, dynamo_backend, dynamo_plugin, deepspeed_plugins, parallelism_config: strategy
            settings.
        strategy: hasten only: the engine to train with, by its registered name (``"fsdp"``, ``"deepspeed"``, or an
            engine registered beyond hasten's, see docs/architecture.md) or as an instance of its plugin class.
    """

    def __init__(
        self,
        device_placement: bool = True,
        split_batches: bool = _UNSET,
        mixed_precision: str | None = None,
        gradient_accumulation_steps: int = 1,
        cpu: bool = False,
        dataloader_config: DataLoaderConfiguration | None = None,
        deepspeed_plugin=None,
        fsdp_plugin=None,
        torch_tp_plugin=None,
        megatron_lm_plugin=None,
        rng_types: list[str | RNGType] | None = None,
        log_with=None,
        project_dir: str | None = None,
        project_config: ProjectConfiguration | None = None,
        gradient_accumulation_plugin: GradientAccumulationPlugin | None = None,
        step_scheduler_with_optimizer: bool = True,
        kwargs_handlers: list[KwargsHandler] | None = None,
        dynamo_backend=None,
        dynamo_plugin=None,
        deepspeed_plugins=None,
        parallelism_config=None,
        strategy=None,
    ):
        refuse_unsupported_plugins(torch_tp_plugin, megatron_lm_plugin, parallelism_config)
        self._set_handlers(kwargs_handlers or [])
        self.project_configuration = project_config or ProjectConfiguration()
        if project_dir is not None:
            self.project_configuration.set_directories(project_dir)
        init_kwargs = self.init_handler.to_kwargs() if self.init_handler is not None else {}
        # The engine settles precision and accumulation first, so that every state below is built once, with final
        # values.
        requested = EngineSettings(
            requested_mixed_precision(mixed_precision),
            resolve_accumulation(gradient_accumulation_steps, gradient_accumulation_plugin),
            {
                "deepspeed_plugin": deepspeed_plugin or deepspeed_plugins,
                "fsdp_plugin": fsdp_plugin,
                "parallelism_config": parallelism_config,
            },
        )
        plan = plan_strategy(requested, PartialState(cpu, **init_kwargs).num_processes, strategy)
        settings = plan.settings
        self.state = AcceleratorState(
            mixed_precision=settings.mixed_precision,
            cpu=cpu,
            dynamo_plugin=build_dynamo_plugin(dynamo_backend, dynamo_plugin),
            _from_accelerator=True,
            **init_kwargs,
        )
        self.state.record_engine(plan.engine, plan.arguments(), settings.mixed_precision)
        self.dataloader_config = dataloader_config or DataLoaderConfiguration()
        if split_batches is not _UNSET:
            self.dataloader_config.split_batches = bool(split_batches)
        self._accumulation = settings.accumulation  # the accumulation settings' one holder (GradientState gets a copy)
        self.gradient_state = GradientState(gradient_accumulation_plugin=settings.accumulation)
        self.device_placement = device_placement
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.rng_types = rng_types if rng_types is not None else ["generator"]
        fp8_recipe = self.ao_recipe_handler or self.fp8_recipe_handler
        self.precision = Precision(
            self.state.mixed_precision, self.device, self.autocast_handler, self.scaler_handler, fp8_recipe
        )
        self._strategy = plan.build(self.state, self.gradient_state, self.precision, ddp_kwargs=self.ddp_handler)
        self.step = 0
        self._models: list = []
        self._optimizers: list = []
        self._schedulers: list = []
        self._dataloaders: list = []
        self._custom_objects: list = []
        self._save_hooks: OrderedDict = OrderedDict()  # weak-referenceable, as RemovableHandle needs
        self._load_hooks: OrderedDict = OrderedDict()
        self._trigger: torch.Tensor | None = None
        from .tracking import TrackerHub

        self._tracker_hub = TrackerHub(log_with, self.project_configuration.logging_dir, self.is_main_process)
        environment.check_os_kernel()
        preemption.install(self)

    def _set_handlers(self, handlers: list) -> None:
        for attribute in _HANDLERS.values():
            setattr(self, attribute, None)
        for handler in handlers:
            attribute = next((a for cls, a in _HANDLERS.items() if isinstance(handler, cls)), None)
            if attribute is None:
                raise ConfigError(
                    f"kwargs_handlers: {type(handler).__name__} is not a supported handler; use one of "
                    f"{[c.__name__ for c in _HANDLERS]}."
                )
            if getattr(self, attribute) is not None:
                raise ConfigError(
                    f"kwargs_handlers holds two {type(handler).__name__} objects; pass at most one of each."
                )
            setattr(self, attribute, handler)

    # ------------------------------------------------------------------------------- process info

    @property
    def device(self) -> torch.device:
        """The device of this process."""
        return self.state.device

    @property
    def distributed_type(self) -> DistributedType:
        """How the job is distributed (NO, MULTI_CPU, MULTI_GPU, DEEPSPEED, FSDP, ...)."""
        return self.state.distributed_type

    @property
    def num_processes(self) -> int:
        """Number of processes in the job."""
        return self.state.num_processes

    @property
    def process_index(self) -> int:
        """Global rank of this process."""
        return self.state.process_index

    @property
    def local_process_index(self) -> int:
        """Rank of this process on its machine."""
        return self.state.local_process_index

    @property
    def multi_device(self) -> bool:
        """True when several processes share the work."""
        return self.num_processes > 1

    @property
    def mixed_precision(self) -> str:
        """The mixed precision in force."""
        return self.state.mixed_precision

    @property
    def native_amp(self) -> bool:
        """True when autocast is in use."""
        return self.precision.enabled

    @property
    def scaler(self):
        """The fp16 gradient scaler (None otherwise, or when the engine scales the loss itself)."""
        return self._strategy.scaler

    @property
    def is_fsdp2(self) -> bool:
        """True when the FSDP strategy is in use."""
        return self.state.is_fsdp2

    @property
    def replicates_model(self) -> bool:
        """hasten only: True when every process holds the whole prepared model (one device, DDP), False when the
        engine shards it (FSDP, DeepSpeed); ``LocalSGD`` averages only a replicated model."""
        return self._strategy.replicates_model

    def wait_for_everyone(self) -> None:
        """Barrier: block until every process reaches this point."""
        self.state.wait_for_everyone()

    # --------------------------------------------------------------------------------- preparing

    def prepare(self, *args, device_placement: list[bool] | None = None):
        """Prepare models, optimizers, dataloaders and schedulers for the current setup, in any order.

        Models go to the device and are wrapped by the strategy (DDP, FSDP, DeepSpeed); optimizers
        become :class:`~hasten.optimizer.AcceleratedOptimizer`; dataloaders are sharded; schedulers
        become :class:`~hasten.scheduler.AcceleratedScheduler`. Other objects pass through. The objects
        come back in the order given (a single object when one was passed).

        Args:
            device_placement: one boolean per argument, overriding ``device_placement`` for models.
        """
        if device_placement is None:
            device_placement = [self.device_placement] * len(args)
        elif len(device_placement) != len(args):
            raise ConfigError(
                f"prepare got {len(args)} objects but {len(device_placement)} device_placement values; give one per "
                "object."
            )
        result = list(args)
        kinds = [self._kind(obj) for obj in args]
        for obj, kind in zip(args, kinds):
            if kind == "prepared":
                self._adopt(obj)
        for i, kind in enumerate(kinds):
            if kind == "dataloader":
                result[i] = self.prepare_data_loader(args[i], device_placement=device_placement[i])
        model_idx = [i for i, k in enumerate(kinds) if k == "model"]
        opt_idx = [i for i, k in enumerate(kinds) if k == "optimizer"]
        sched_idx = [i for i, k in enumerate(kinds) if k == "scheduler"]
        for i in model_idx:
            self._check_model(args[i])
        models, optimizers, schedulers = self._strategy.prepare(
            [args[i] for i in model_idx],
            [args[i] for i in opt_idx],
            [args[i] for i in sched_idx],
            [device_placement[i] for i in model_idx],
            [result[i] for i, k in enumerate(kinds) if k == "dataloader"],
        )
        for i, model in zip(model_idx, models):
            model = self._strategy.compile_model(model, self.state.dynamo_plugin)
            result[i] = model
            self._models.append(self._strategy.tracked_model(model))
        for i, raw, optimizer in zip(opt_idx, [args[i] for i in opt_idx], optimizers):
            result[i] = self._wrap_optimizer(optimizer, device_placement[i], raw)
        for i, scheduler in zip(sched_idx, schedulers):
            result[i] = self._wrap_scheduler(scheduler)
        if model_idx:  # as in Accelerate, loaders prepared with the model are split for its sequence parallelism
            for i, kind in enumerate(kinds):
                if kind == "dataloader":
                    result[i] = self._strategy.sequence_parallel_loader(result[i], result[model_idx[0]])
        for i in model_idx:
            _mark_prepared(result[i])
        return result[0] if len(result) == 1 else tuple(result)

    def prepare_model(
        self, model: torch.nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ) -> torch.nn.Module:
        """Prepare one model; with ``evaluation_mode`` it is placed and cast but not wrapped for training."""
        if getattr(model, "_is_accelerate_prepared", False):
            self._adopt(model)
            return model
        self._check_model(model)
        place = self.device_placement if device_placement is None else device_placement
        prepared = self._strategy.compile_model(
            self._strategy.setup_model(model, place, evaluation_mode=evaluation_mode), self.state.dynamo_plugin
        )
        self._models.append(self._strategy.tracked_model(prepared))
        return _mark_prepared(prepared)

    def prepare_optimizer(
        self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None
    ) -> AcceleratedOptimizer:
        """Wrap one optimizer (prepare its model first)."""
        if isinstance(optimizer, AcceleratedOptimizer) or getattr(optimizer, "_is_accelerate_prepared", False):
            self._adopt(optimizer)
            return optimizer
        place = self.device_placement if device_placement is None else device_placement
        rebound = self._strategy.setup_optimizer(optimizer, self._models, self._models)
        return self._wrap_optimizer(rebound, place, optimizer)

    def prepare_scheduler(self, scheduler) -> AcceleratedScheduler:
        """Wrap one learning rate scheduler (prepare its optimizer first)."""
        if isinstance(scheduler, AcceleratedScheduler) or getattr(scheduler, "_is_accelerate_prepared", False):
            self._adopt(scheduler)
            return scheduler
        return self._wrap_scheduler(scheduler)

    def prepare_data_loader(
        self, data_loader, device_placement: bool | None = None, slice_fn_for_dispatch: Callable | None = None
    ):
        """Shard one dataloader between processes (see :func:`hasten.data_loader.prepare_data_loader`)."""
        if isinstance(data_loader, DataLoaderStateMixin) or getattr(data_loader, "_is_accelerate_prepared", False):
            self._adopt(data_loader)
            return data_loader
        config = self.dataloader_config
        dp_size, dp_rank = self._strategy.data_parallel_world
        prepared = prepare_loader_for(
            Sharing(dp_size, dp_rank, self.state, self.gradient_state),
            data_loader,
            self.device,
            split_batches=config.split_batches,
            put_on_device=self.device_placement if device_placement is None else device_placement,
            rng_types=list(self.rng_types),
            dispatch_batches=config.dispatch_batches,
            even_batches=config.even_batches,
            slice_fn_for_dispatch=slice_fn_for_dispatch,
            use_seedable_sampler=config.use_seedable_sampler,
            data_seed=config.data_seed,
            non_blocking=config.non_blocking,
            use_stateful_dataloader=config.use_stateful_dataloader,
        )
        self._dataloaders.append(prepared)
        return _mark_prepared(prepared)

    def skip_first_batches(self, dataloader, num_batches: int = 0):
        """A loader whose iterations start at batch ``num_batches`` of the epoch: for a prepared one, a view of it (of
        its class, sharing its epoch and position); see :func:`~hasten.data_loader.skip_first_batches`."""
        return skip_first_batches(dataloader, num_batches)

    def unwrap_model(
        self, model: torch.nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True
    ) -> torch.nn.Module:
        """The user's model from inside the wrappers ``prepare`` added."""
        return self._strategy.unwrap_model(
            model, keep_fp32_wrapper=keep_fp32_wrapper, keep_torch_compile=keep_torch_compile
        )

    @staticmethod
    def verify_device_map(model: torch.nn.Module) -> bool:
        """True when ``model`` (or a submodule) was dispatched over several devices with a ``device_map``."""
        for module in model.modules():
            device_map = getattr(module, "hf_device_map", None)
            if isinstance(device_map, dict) and len(set(device_map.values())) > 1:
                return True
        return False

    # ---------------------------------------------------------------------------------- training

    @property
    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step."""
        return self._accumulation.num_steps or 1

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, steps: int) -> None:
        self._accumulation.num_steps = steps
        self.gradient_state.plugin_kwargs["num_steps"] = steps  # for the readers of Accelerate's GradientState

    @property
    def sync_gradients(self) -> bool:
        """True on steps where gradients are synchronised and the optimizer steps."""
        return self.gradient_state.sync_gradients

    @sync_gradients.setter
    def sync_gradients(self, value: bool) -> None:
        self.gradient_state.sync_gradients = value

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """True when the last optimizer step was skipped (fp16 overflow); skip the scheduler step too."""
        return any(optimizer.step_was_skipped for optimizer in self._optimizers)

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """Use instead of ``loss.backward()``: divides by the accumulation steps, scales for fp16, runs the engine's
        backward."""
        self.gradient_state.record_backward()
        self._strategy.backward(loss, self.gradient_accumulation_steps, **kwargs)

    def _do_sync(self) -> bool:
        """Count one micro-batch; returns (and publishes in ``GradientState``) whether its gradients are synced."""
        if self._accumulation.sync_with_dataloader and self.gradient_state.end_of_dataloader:
            self.step = 0
            sync = True
        else:
            self.step += 1
            sync = self.step % self.gradient_accumulation_steps == 0
        self.gradient_state._set_sync_gradients(sync)
        return sync

    @contextlib.contextmanager
    def accumulate(self, *models: torch.nn.Module):
        """Context manager for one micro-batch of gradient accumulation.

        Sets :attr:`sync_gradients` (True every ``gradient_accumulation_steps`` micro-batches and on the
        last batch of the dataloader) and suppresses gradient reduction on the other micro-batches.
        """
        sync = self._do_sync()
        if sync or not models or (self._accumulation.sync_each_batch and self.use_distributed):
            yield  # gradients are reduced in this backward: nothing to enter
            return
        with contextlib.ExitStack() as stack:
            for model in models:
                stack.enter_context(self.no_sync(model))
            yield

    def no_sync(self, model: torch.nn.Module):
        """Context manager in which backward does not reduce gradients across processes."""
        return self._strategy.no_sync(model)

    def trigger_sync_in_backward(self, model: torch.nn.Module):
        """Context manager forcing gradient reduction in the next backward, even inside :meth:`no_sync`."""
        return self._strategy.sync_in_backward(model)

    def autocast(self, autocast_handler: AutocastKwargs | None = None):
        """Context manager running code outside the model (e.g. the loss) under the mixed precision policy."""
        return self.precision.autocast(autocast_handler)

    def unscale_gradients(self, optimizer=None) -> None:
        """Divide fp16-scaled gradients by the loss scale (done once per step; clipping calls it)."""
        if self.scaler is None:
            return
        optimizers = [optimizer] if optimizer is not None else self._optimizers
        for opt in optimizers:
            while isinstance(opt, AcceleratedOptimizer):
                opt = opt.optimizer
            try:
                self.scaler.unscale_(opt)
            except RuntimeError as error:
                if "already been called" not in str(error):
                    raise

    def clip_grad_norm_(self, parameters, max_norm: float, norm_type: float = 2) -> torch.Tensor:
        """Clip gradients to a total norm of ``max_norm`` (after fp16 unscaling) and return the total norm.

        Correct under every strategy (sharded gradients give the global norm). Call it on steps where
        :attr:`sync_gradients` is True; during accumulation gradients are incomplete.
        """
        parameters = list(parameters) if not isinstance(parameters, torch.Tensor) else [parameters]
        if not self.sync_gradients:
            warn_once(
                "clip-while-accumulating",
                "clip_grad_norm_ was called on an accumulation step, before the gradients are complete; guard it with "
                "`if accelerator.sync_gradients:`.",
            )
        self.unscale_gradients()
        return self._strategy.clip_grad_norm_(parameters, max_norm, norm_type)

    def clip_grad_value_(self, parameters, clip_value: float) -> None:
        """Clamp every gradient to ``[-clip_value, clip_value]`` (after fp16 unscaling)."""
        self.unscale_gradients()
        self._strategy.clip_grad_value_(parameters, clip_value)

    # --------------------------------------------------------------------------- collectives

    def gather(self, tensor):
        """Gather (nested) tensors from all processes, concatenated on the first dimension."""
        return operations.gather(tensor)

    def gather_for_metrics(self, input_data, use_gather_object: bool = False):
        """Gather evaluation outputs from all processes, dropping the samples padded in at the end of the data."""
        return self._strategy.gather_for_metrics(input_data, use_gather_object=use_gather_object)

    def reduce(self, tensor, reduction: str = "sum", scale: float = 1.0):
        """All-reduce (nested) tensors: ``"sum"`` (default here), ``"mean"``, ``"max"``, ``"min"``."""
        return operations.reduce(tensor, reduction=reduction, scale=scale)

    def pad_across_processes(self, tensor, dim: int = 0, pad_index: int = 0, pad_first: bool = False):
        """Pad (nested) tensors to the largest size of ``dim`` across processes."""
        return operations.pad_across_processes(tensor, dim=dim, pad_index=pad_index, pad_first=pad_first)

    def set_trigger(self) -> None:
        """Raise this process's flag; the next :meth:`check_trigger` returns True on every process."""
        self._trigger_tensor().fill_(1)

    def check_trigger(self) -> bool:
        """True on every process if any process called :meth:`set_trigger` since the last check (then resets)."""
        flag = self._trigger_tensor()
        if operations.reduce(flag, reduction="max").item() > 0:
            flag.fill_(0)
            return True
        return False

    set_breakpoint = set_trigger
    check_breakpoint = check_trigger

    def _trigger_tensor(self) -> torch.Tensor:
        if self._trigger is None:
            self._trigger = torch.zeros((), dtype=torch.int32, device=self.device)
        return self._trigger

    @contextlib.contextmanager
    def profile(self, profile_handler: ProfileKwargs | None = None):
        """Context manager profiling its block with ``torch.profiler`` (see :class:`~hasten.ProfileKwargs`)."""
        handler = profile_handler or self.profile_handler or ProfileKwargs()
        with handler.build() as profiler:
            yield profiler
        if handler.output_trace_dir:
            import os

            os.makedirs(handler.output_trace_dir, exist_ok=True)
            profiler.export_chrome_trace(os.path.join(handler.output_trace_dir, f"profile_{self.process_index}.json"))

    def end_training(self) -> None:
        """Wait for an asynchronous save in flight, finish every tracker and destroy the process group hasten
        created."""
        from .checkpointing import end_background_saves

        end_background_saves()
        self._tracker_hub.finish()
        self.state.destroy_process_group()

    # ---------------------------------------------------------------------------------- memory

    def free_memory(self, *objects):
        """Drop every reference the Accelerator holds to prepared objects, collect garbage, empty device caches.

        Returns ``objects`` replaced by ``None`` (``model, optimizer = accelerator.free_memory(model, optimizer)``).
        """
        self._models.clear()
        self._optimizers.clear()
        self._schedulers.clear()
        self._dataloaders.clear()
        self.step = 0
        return release_memory(*objects)

    def clear(self, *objects):
        """Alias of :meth:`free_memory`."""
        return self.free_memory(*objects)

    def __repr__(self) -> str:
        return f"Accelerator(\n{self.state!r})"
