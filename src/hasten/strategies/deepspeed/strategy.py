"""DeepSpeed ZeRO (stages 0-3, CPU/NVMe offload) behind the Strategy interface.

``prepare`` resolves the config's ``"auto"`` values from the prepared objects and calls
``deepspeed.initialize`` once with the model, optimizer and scheduler. The training loop stays the
four-line loop of any other strategy: ``accelerator.backward(loss)`` runs the engine's backward and,
at the end of each accumulation cycle, the engine's step (clipping, optimizer step, scheduler step,
zeroing), so ``optimizer.step()``/``zero_grad()``/``scheduler.step()`` have nothing left to do.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
from typing import Iterable

import torch

from ...enums import DistributedType
from ...errors import CheckpointError, ConfigError, NotSupportedError
from ...logging import get_logger
from ...runtime.compilation import compile_regions_deepspeed, compile_settings
from ...runtime.operations import barrier
from ...scheduler import AcceleratedScheduler
from ...state import warn_once
from ..base import EngineSettings, Strategy, _suffix
from . import config as dsc
from . import zero3
from .checkpoint import check_world_size, saved_under_zero3, verified_loader
from .dummies import DummyOptim, DummyScheduler, map_pytorch_optim_to_deepspeed
from .other_engines import CHECKPOINT_FOLDER as _CHECKPOINT_FOLDER
from .other_engines import TAG as _TAG
from .other_engines import resume_other_engine_checkpoint
from .resharding import engine_checkpoint, link_optimizer_views, read_zero_checkpoint, resume_on_this_world
from .ulysses import DeepSpeedSequenceParallel, check_deepspeed_layout


class DeepSpeedSchedulerWrapper(AcceleratedScheduler):
    """The prepared scheduler under DeepSpeed: the engine steps it after each real optimizer step.

    ``prepare`` returns one for every scheduler it hands to the DeepSpeed engine (the config's, a
    ``DummyScheduler``'s or the script's own), so ``step()`` does nothing; ``get_last_lr``,
    ``state_dict``, ``load_state_dict`` and every other attribute are the engine scheduler's.
    transformers' Trainer tells the engine's scheduler from its own by this class.

    Args:
        scheduler: the scheduler the engine steps.
        optimizers: the optimizer(s) it follows.
        state, gradient_state: hasten only: the Accelerator's, as :class:`~hasten.scheduler.AcceleratedScheduler`
            takes them.
    """

    def __init__(self, scheduler, optimizers, *, state=None, gradient_state=None):
        super().__init__(scheduler, optimizers, state=state, gradient_state=gradient_state)

    def step(self):
        """No-op: ``accelerator.backward`` runs the engine's step, which steps this scheduler."""


class _OverflowMonitor:
    """Counts fp16 steps skipped for overflow and says so every ``every`` skips, with the guide's advice."""

    def __init__(self, every: int = 20):
        self.every = every
        self.steps = 0
        self.skipped = 0

    def record(self, skipped: bool, loss_scale, loss: torch.Tensor | None) -> None:
        """Record one optimizer step; warn on the first skip and every ``every`` skips after it."""
        self.steps += 1
        if not skipped:
            return
        self.skipped += 1
        if loss is not None and not bool(torch.isfinite(loss.detach()).all()):
            warn_once(
                "deepspeed-nan-loss",
                "The loss is NaN/inf under fp16. This usually happens with a model pretrained in bf16 (e.g. on TPUs) "
                "whose activations overflow fp16's range: train in bf16 (Ampere GPUs or newer, TPUs) or in fp32 "
                "instead.",
            )
        if self.skipped == 1 or self.skipped % self.every == 0:
            scale = f"; the loss scale is now {loss_scale:g}" if isinstance(loss_scale, (int, float)) else ""
            get_logger("hasten.deepspeed").warning(
                f"fp16 overflow: the optimizer step was skipped ({self.skipped} of {self.steps} steps skipped so "
                f"far{scale}). A few skips while the loss scale settles are normal. If they keep coming, raise "
                "fp16.initial_scale_power in the DeepSpeed config (32 usually works), or train in bf16 or fp32."
            )


class DeepSpeedStrategy(Strategy):
    """Trains one model with a DeepSpeed engine (ZeRO stages 0-3, CPU/NVMe offload, fp16/bf16).

    Args:
        plugin: the :class:`~hasten.strategies.deepspeed.plugin.DeepSpeedPlugin` (or a dict with one plugin).
        accumulation: the Accelerator's ``GradientAccumulationPlugin`` (its steps fill the config's ``"auto"``).
    """

    distributed_type = DistributedType.DEEPSPEED

    @classmethod
    def build(cls, state, precision, settings, ddp_kwargs=None) -> DeepSpeedStrategy:
        """The engine for the settled ``DeepSpeedPlugin``, accumulation settings and ``ParallelismConfig``."""
        return cls(
            state, precision, settings.plugin, settings.accumulation, settings.arguments.get("parallelism_config")
        )

    def __init__(self, state, precision, plugin, accumulation, parallelism_config=None):
        super().__init__(state, precision)
        self.parallelism_config = parallelism_config
        if parallelism_config is not None:
            check_deepspeed_layout(parallelism_config)
        self._sequence = (
            DeepSpeedSequenceParallel(parallelism_config, state)
            if parallelism_config is not None and parallelism_config.sp_enabled
            else None
        )
        self.plugin = _single_plugin(plugin)
        self.accumulation = accumulation
        self.plugin.select()
        self.engine = None
        self._monitor = _OverflowMonitor()
        self._skipped = False
        self._syncs_in_a_row = 0
        self._reader = None
        self._dummy_optimizer = None
        self._dummy_scheduler = None

    @classmethod
    def resolve(cls, settings: EngineSettings) -> EngineSettings:
        """The DeepSpeed config's precision and accumulation steps win over the script's (with a warning or an error).

        The requested precision fills the config's ``fp16``/``bf16`` ``"auto"`` sections; a config that
        enables one itself sets the precision in force. The config's ``gradient_accumulation_steps``
        becomes the Accelerator's when the script left it at 1; two different values are an error.
        """
        plugin = _single_plugin(settings.plugin)
        requested = settings.mixed_precision
        dsc.apply_mixed_precision(plugin.deepspeed_config, requested, plugin.config_name)
        chosen = dsc.mixed_precision_of(plugin.deepspeed_config)
        if chosen != requested:
            warn_once(
                "deepspeed-precision",
                f"{plugin.config_name} trains in {chosen} while mixed_precision is {requested!r}: "
                f"the DeepSpeed config wins. Pass mixed_precision={chosen!r} to silence this warning.",
            )
        return dataclasses.replace(
            settings, mixed_precision=chosen, accumulation=_accumulation(plugin, settings.accumulation)
        )

    # ---------------------------------------------------------------------------------- preparing

    def prepare(self, models, optimizers, schedulers, device_placement, dataloaders):
        """Resolve the config and create the DeepSpeed engine from the model, optimizer and scheduler."""
        if not models:
            if optimizers or schedulers:
                raise ConfigError(
                    "Under DeepSpeed, prepare the model with its optimizer and scheduler in one call: "
                    "accelerator.prepare(model, optimizer, dataloader, scheduler)."
                )
            return models, optimizers, schedulers
        if self.engine is not None or len(models) > 1 or len(optimizers) > 1 or len(schedulers) > 1:
            raise NotSupportedError(
                "hasten's DeepSpeed strategy trains one model with one optimizer and one scheduler per Accelerator. "
                "Prepare them in a single prepare() call; models used only for inference can be placed with "
                "accelerator.prepare_model(model, evaluation_mode=True)."
            )
        import deepspeed

        model = models[0]
        optimizer = optimizers[0] if optimizers else None
        scheduler = schedulers[0] if schedulers else None
        self.state.partial_state.ensure_process_group()
        _give_launcher_variables(self.state)
        config = copy.deepcopy(self.plugin.deepspeed_config)
        kwargs = {"model": model, "config": config}
        optimizer, scheduler = self._engine_optimizer(config, optimizer, scheduler, kwargs)
        self._resolve(config, model, dataloaders)
        if self._sequence is not None:
            self._sequence.prepare(model, config["train_micro_batch_size_per_gpu"], kwargs)
        zero3.set_moe_leaf_modules(model, self.plugin.transformer_moe_cls_names)
        engine, engine_optimizer, _, engine_scheduler = deepspeed.initialize(**kwargs)
        self.plugin.deepspeed_config = self.plugin.hf_ds_config.config = config
        self.engine = engine
        _install_safe_loader(engine, self)
        prepared_optimizers = [engine_optimizer] if optimizer is not None else []
        prepared_schedulers = (
            [
                DeepSpeedSchedulerWrapper(
                    engine_scheduler, prepared_optimizers, state=self.state, gradient_state=self.gradient_state
                )
            ]
            if scheduler is not None
            else []
        )
        return [engine], prepared_optimizers, prepared_schedulers

    def _engine_optimizer(self, config: dict, optimizer, scheduler, kwargs: dict):
        """Put the optimizer and scheduler (or the config's) into ``kwargs`` for ``deepspeed.initialize``."""
        name = self.plugin.config_name
        if isinstance(optimizer, DummyOptim):
            if "optimizer" not in config:
                raise ConfigError(
                    f'DummyOptim stands for the optimizer of the DeepSpeed config, but {name} has no "optimizer" '
                    "section. Add one, or pass a torch optimizer."
                )
            kwargs["model_parameters"] = optimizer.params
        elif optimizer is not None:
            if "optimizer" in config:
                raise ConfigError(
                    f"{name} defines an optimizer and the script passes {type(optimizer).__name__} too. Pass "
                    'DummyOptim(params, lr=...) to use the config\'s, or remove its "optimizer" section.'
                )
            if dsc.get_value(config, "zero_optimization.offload_optimizer.device", "none") in ("cpu", "nvme"):
                replacement = map_pytorch_optim_to_deepspeed(optimizer)
                if scheduler is not None and getattr(scheduler, "optimizer", None) is optimizer:
                    scheduler.optimizer = replacement
                optimizer = replacement
            config.setdefault("zero_allow_untested_optimizer", True)
            kwargs["optimizer"] = optimizer
        if isinstance(scheduler, DummyScheduler) and "scheduler" not in config:
            if scheduler.lr_scheduler_callable is None:
                raise ConfigError(
                    f'DummyScheduler stands for the scheduler of the DeepSpeed config, but {name} has no "scheduler" '
                    "section. Add one, or pass DummyScheduler(..., lr_scheduler_callable=...)."
                )
            kwargs["lr_scheduler"] = scheduler.lr_scheduler_callable
        elif scheduler is not None and not isinstance(scheduler, DummyScheduler):
            if "scheduler" in config:
                raise ConfigError(
                    f"{name} defines a scheduler and the script passes {type(scheduler).__name__} too. Pass "
                    'DummyScheduler(optimizer, ...) to use the config\'s, or remove its "scheduler" section.'
                )
            kwargs["lr_scheduler"] = scheduler
        self._dummy_optimizer = optimizer if isinstance(optimizer, DummyOptim) else None
        self._dummy_scheduler = (
            scheduler if isinstance(scheduler, DummyScheduler) and scheduler.lr_scheduler_callable is None else None
        )
        return optimizer, scheduler

    def _resolve(self, config: dict, model, dataloaders: list) -> None:
        """Fill the config's ``"auto"`` values from the script and log the result once."""
        script = self._script_values(model, dataloaders)
        must = ["gradient_accumulation_steps"]
        if "gradient_clipping" in self.plugin.explicit_fields:
            must.append("gradient_clipping")
        notes = dsc.fill(config, dsc.auto_values(script), self.plugin.config_name, must_match=tuple(must))
        dsc.check_resolved(config, self.plugin.config_name)
        logger = get_logger("hasten.deepspeed")
        for note in notes:
            logger.warning(f"The DeepSpeed config's value is used: {note}.")
        logger.info(f"DeepSpeed config in use ({self.plugin.config_name}, resolved):\n{dsc.describe(config)}")

    def _script_values(self, model, dataloaders: list) -> dsc.ScriptValues:
        num = self.state.num_processes
        steps = self.accumulation.num_steps or 1
        script = dsc.ScriptValues(
            num_processes=self._sequence.batch_processes if self._sequence else num,
            mixed_precision=dsc.mixed_precision_of(self.plugin.deepspeed_config),
        )
        script.gradient_accumulation_steps = dsc.Setting(steps, f"Accelerator(gradient_accumulation_steps={steps})")
        sizes = [_per_process_batch(loader, self.data_parallel_world[0]) for loader in dataloaders]
        sizes = [size for size in sizes if size]
        if sizes:
            micro = min(sizes) if self.plugin.is_train_batch_min else max(sizes)
            script.micro_batch_size = dsc.Setting(micro, f"the prepared dataloader (batch size {micro} per process)")
        clip = self.plugin.explicit_fields.get("gradient_clipping")
        if clip is not None:
            script.gradient_clipping = clip
        hidden = _hidden_size(model)
        if hidden is not None:
            script.hidden_size = dsc.Setting(hidden, f"the model's config.hidden_size={hidden}")
        if self._dummy_optimizer is not None:
            script.optimizer = _optimizer_values(self._dummy_optimizer)
        if self._dummy_scheduler is not None:
            split = any(getattr(loader, "split_batches", False) for loader in dataloaders)
            script.scheduler = _scheduler_values(self._dummy_scheduler, self._dummy_optimizer, 1 if split else num)
        return script

    def compile_model(self, model: torch.nn.Module, dynamo_plugin) -> torch.nn.Module:
        """The engine compiles its module in place, as under Accelerate: ``engine.compile`` for the whole model, or
        the module's regions (:func:`~hasten.runtime.compilation.compile_regions_deepspeed`); the engine is returned.
        Models outside the engine (inference only) are compiled as by the base strategy."""
        kwargs = compile_settings(model, dynamo_plugin)
        if model is not self.engine or kwargs is None:
            return super().compile_model(model, dynamo_plugin)
        if dynamo_plugin.use_regional_compilation:
            compile_regions_deepspeed(model.module, **kwargs)
        else:
            model.compile(backend=kwargs.pop("backend"), compile_kwargs=kwargs)
        return model

    @property
    def data_parallel_world(self) -> tuple[int, int]:
        """As the base strategy; with hasten's Ulysses the ``sp`` ranks read the same batches."""
        return self._sequence.data_parallel_world if self._sequence else super().data_parallel_world

    @property
    def device_mesh(self):
        """With sequence parallelism, the layout's mesh (its ``sp`` dimension over DeepSpeed's groups' ranks)."""
        return self._sequence.mesh if self._sequence else None

    def sequence_parallel_loader(self, loader, model: torch.nn.Module | None = None):
        """With sequence parallelism, ``loader`` split as Accelerate splits it (DeepSpeed's
        ``UlyssesSPDataLoaderAdapter``) or, with ``sp_backend="accelerate"``, by hasten's adapter."""
        return self._sequence.loader(loader, model) if self._sequence else loader

    def gather_for_metrics(self, input_data, use_gather_object: bool = False):
        """As the base strategy; with hasten's Ulysses, one copy of each sample (the ``sp`` ranks share batches)."""
        if self._sequence is None or self._sequence.uses_deepspeed_ulysses:
            return super().gather_for_metrics(input_data, use_gather_object)
        from ..tensor_parallel import gather_for_metrics_over_dp

        return gather_for_metrics_over_dp(
            input_data, self.parallelism_config.sp_size, self.gradient_state, use_gather_object
        )

    def setup_model(
        self, model: torch.nn.Module, device_placement: bool = True, evaluation_mode: bool = False
    ) -> torch.nn.Module:
        """Place a model used outside the engine (inference only); training models go through :meth:`prepare`."""
        if not evaluation_mode and any(p.requires_grad for p in model.parameters()):
            raise NotSupportedError(
                "Under DeepSpeed, a model to train is prepared together with its optimizer: "
                "accelerator.prepare(model, optimizer, dataloader, scheduler). Use prepare_model(model, "
                "evaluation_mode=True) for inference-only models."
            )
        return model.to(self.device) if device_placement else model

    # ---------------------------------------------------------------------------------- training

    def _require_engine(self):
        if self.engine is None:
            raise ConfigError(
                "No DeepSpeed engine yet: call accelerator.prepare(model, optimizer, ...) before training."
            )
        return self.engine

    def backward(self, loss: torch.Tensor, accumulation_steps: int = 1, **kwargs) -> None:
        """The engine's backward (it divides by its accumulation steps); at a sync step, also the engine's step."""
        engine = self._require_engine()
        sync = self.gradient_state.sync_gradients
        if engine.managed_gradient_accumulation():
            engine.set_gradient_accumulation_boundary(sync)
        engine.backward(loss, **kwargs)
        if not sync:
            self._syncs_in_a_row = 0
            return
        before = engine.skipped_steps
        engine.step()
        self._skipped = engine.skipped_steps > before
        self._monitor.record(self._skipped, getattr(engine.optimizer, "loss_scale", None), loss)
        self._check_accumulation_loop(engine)

    def _check_accumulation_loop(self, engine) -> None:
        self._syncs_in_a_row += 1
        steps = engine.gradient_accumulation_steps()
        if steps > 1 and self._syncs_in_a_row > steps:
            warn_once(
                "deepspeed-no-accumulate",
                f"gradient_accumulation_steps={steps}, but every backward is a synchronisation step: the engine steps "
                "on every micro-batch with a loss divided by the accumulation steps. Run each step inside `with "
                "accelerator.accumulate(model):`.",
            )

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor | None:
        """The engine clips with the config's ``gradient_clipping``; returns the global gradient norm of the last
        step."""
        engine = self._require_engine()
        configured = engine.gradient_clipping()
        if not configured or not math.isclose(configured, float(max_norm)):
            warn_once(
                "deepspeed-clip",
                f"clip_grad_norm_(max_norm={max_norm}) under DeepSpeed: the engine clips with gradient_clipping from "
                f"the DeepSpeed config, which is {configured or 'not set (no clipping)'}. Set "
                f"DeepSpeedPlugin(gradient_clipping={max_norm}) "
                'or "gradient_clipping" in the config to clip at this value.',
            )
        norm = engine.get_global_grad_norm()
        return None if norm is None else torch.as_tensor(norm, dtype=torch.float32)

    def clip_grad_value_(self, parameters, clip_value: float) -> None:
        """Not available: DeepSpeed clips by norm only."""
        raise NotSupportedError(
            "DeepSpeed clips gradients by norm only: use accelerator.clip_grad_norm_ and set gradient_clipping in the "
            "DeepSpeed config."
        )

    @property
    def scaler(self):
        """None: the engine scales the fp16 loss itself."""
        return None

    @property
    def handles_optimizer_step(self) -> bool:
        """True: the engine steps and zeroes the optimizer."""
        return True

    def optimizer_step(self, optimizer, closure=None):
        """Nothing to do: the engine stepped at the end of ``backward``."""
        return None

    @property
    def step_was_skipped(self) -> bool:
        """True when the engine skipped the last step because fp16 gradients overflowed."""
        return self._skipped

    # --------------------------------------------------------------------------------- state dicts

    @property
    def saves_full_state_dicts(self) -> bool:
        """False: the engine writes its own (sharded) files into checkpoints."""
        return False

    @property
    def save_needs_every_process(self) -> bool:
        """True: every process writes its shards (or takes part in gathering them), so all must call ``save_state``."""
        return True

    def tracked_model(self, prepared: torch.nn.Module) -> torch.nn.Module:
        """The prepared model itself, as Accelerate keeps it for this engine (hooks and checkpoints get it)."""
        return prepared

    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The full state dict; under ZeRO-3 gathered on the main process (empty on the others)."""
        engine = self.engine if model is self.engine else None
        if engine is None:
            return super().get_state_dict(model, unwrap)
        if engine.zero_optimization_partition_weights():
            if not engine.zero_gather_16bit_weights_on_model_save():
                raise ConfigError(
                    "The model is partitioned (ZeRO-3) and the config does not gather it for saving. Set "
                    '"stage3_gather_16bit_weights_on_model_save": true under zero_optimization (or '
                    "DeepSpeedPlugin(zero3_save_16bit_model=True)), "
                    "or save the training state with accelerator.save_state(dir) and turn it into one model file with "
                    "`hasten merge-weights dir OUTPUT_DIR`."
                )
            return engine._zero3_consolidated_16bit_state_dict() or {}
        return {name: tensor.detach().cpu().clone() for name, tensor in engine.module.state_dict().items()}

    # --------------------------------------------------------------------------------- checkpoints

    def save_checkpoint(self, writer, models: list, optimizers: list) -> None:
        """The engine writes its (sharded) checkpoint into ``deepspeed/``; other models are saved whole."""
        for i, model in enumerate(models):
            if model is self.engine:
                self.engine.save_checkpoint(str(writer.directory / _CHECKPOINT_FOLDER), tag=_TAG)
                barrier()
                if writer.is_main:
                    writer.track(_CHECKPOINT_FOLDER)
            elif writer.is_main:
                writer.save_tensors(f"model{_suffix(i)}.safetensors", super().get_state_dict(model))

    def load_checkpoint(self, reader, models: list, optimizers: list) -> None:
        """Restore the engine (weights, optimizer, scheduler) and the other models; a ZeRO checkpoint of another
        number of processes is partitioned again (:mod:`~hasten.strategies.deepspeed.resharding`), one of a torch
        optimizer (DDP, one process) is given to the engine by parameter name (:mod:`.other_engines`)."""
        if resume_other_engine_checkpoint(self, reader, models):
            return
        index = next((i for i, model in enumerate(models) if model is self.engine), -1)
        found = engine_checkpoint(reader, index, _CHECKPOINT_FOLDER, _TAG) if index >= 0 else None
        # with DeepSpeed's sequence-parallel groups ZeRO partitions over the sequence-data-parallel ranks
        partitions = self.engine.dp_world_size or getattr(self.engine, "seq_dp_world_size", None)
        saved = check_world_size(found.files, found.path, partitions) if found else None
        # DeepSpeed loads a stage 1 checkpoint under stage 2 and back, but not across stage 3
        other_stage = found is not None and saved_under_zero3(found.files) != (
            self.engine.zero_optimization_stage() == 3
        )
        self._reader = None if found is None or found.accelerate else reader
        try:  # another number of processes or stage: every file is read and checked before anything is loaded
            full = (
                read_zero_checkpoint(found.path, verified_loader(self._reader, mapped=True))
                if saved or other_stage
                else None
            )
            for i, model in enumerate(models):
                if model is not self.engine:
                    self.unwrap_model(model).load_state_dict(reader.load_tensors(f"model{_suffix(i)}.safetensors"))
                elif full is not None:
                    resume_on_this_world(self.engine, full, self.state.is_main_process)
                else:
                    inside = not found.accelerate  # Accelerate saves the scheduler apart (the reader restores it)
                    path, _ = self.engine.load_checkpoint(str(found.folder), found.tag, load_lr_scheduler_states=inside)
                    if path is None:
                        raise CheckpointError(f"DeepSpeed could not load its state from {found.path}.")
                    link_optimizer_views(self.engine)
        finally:
            self._reader = None

    def _load_file(self, path: str, map_location=None):
        """Read one engine checkpoint file: checksum checked against the manifest being loaded, no code executed."""
        return verified_loader(self._reader)(path, map_location)


def _give_launcher_variables(state) -> None:
    """Set ``LOCAL_RANK`` for DeepSpeed, which refuses to start without it, when no launcher did.

    ``python train.py`` (and ``hasten launch --num_processes 1``, which starts the script directly) sets no
    launcher variables; hasten knows this process's place anyway, so DeepSpeed gets it instead of an assertion.
    """
    if "LOCAL_RANK" not in os.environ and "OMPI_COMM_WORLD_LOCAL_RANK" not in os.environ:
        os.environ["LOCAL_RANK"] = str(state.local_process_index)


def _install_safe_loader(engine, strategy: DeepSpeedStrategy) -> None:
    """Route the engine's checkpoint reads through :meth:`DeepSpeedStrategy._load_file` (torch engine only)."""
    checkpoint_engine = getattr(engine, "checkpoint_engine", None)
    if type(checkpoint_engine).__name__ == "TorchCheckpointEngine":
        checkpoint_engine.load = strategy._load_file


def _accumulation(plugin, accumulation):
    """The accumulation plugin with the DeepSpeed config's ``gradient_accumulation_steps`` when the script left 1."""
    configured = plugin.get_value("gradient_accumulation_steps")
    steps = accumulation.num_steps or 1
    if not isinstance(configured, int) or configured == steps:
        return accumulation
    if steps == 1:
        return dataclasses.replace(accumulation, num_steps=configured)
    raise ConfigError(
        f"gradient_accumulation_steps: {configured} in {plugin.config_name}, but {steps} "
        f'from Accelerator(gradient_accumulation_steps={steps}). Make them agree, or set it to "auto" in the config.'
    )


def _single_plugin(plugin):
    if isinstance(plugin, dict):
        if len(plugin) != 1:
            raise NotSupportedError(
                f"hasten runs one DeepSpeed plugin per Accelerator; got {len(plugin)} ({', '.join(map(str, plugin))})."
            )
        plugin = next(iter(plugin.values()))
    return plugin


def _per_process_batch(loader, num_processes: int) -> int | None:
    total = getattr(loader, "total_batch_size", None)
    if num_processes > 1 and isinstance(total, int) and total > 0:
        return max(total // num_processes, 1)
    for size in (
        getattr(loader, "batch_size", None),
        getattr(getattr(loader, "batch_sampler", None), "batch_size", None),
    ):
        if isinstance(size, int) and size > 0:
            return size
    return None


def _hidden_size(model) -> int | None:
    config = getattr(model, "config", None)
    if config is None:
        return None
    get = config.get if isinstance(config, dict) else lambda key: getattr(config, key, None)
    hidden = get("hidden_size")
    if isinstance(hidden, int):
        return hidden
    sizes = get("hidden_sizes")
    return max(sizes) if isinstance(sizes, (list, tuple)) and sizes else None


def _optimizer_values(optimizer) -> dict[str, dsc.Setting]:
    extra = optimizer.kwargs
    where = "DummyOptim"
    return {
        "lr": dsc.Setting(optimizer.lr, f"{where}(lr={optimizer.lr})"),
        "weight_decay": dsc.Setting(optimizer.weight_decay, f"{where}(weight_decay={optimizer.weight_decay})"),
        "betas": dsc.Setting(
            list(extra.get("betas", (0.9, 0.999))),
            f"{where}(betas=...)" if "betas" in extra else "the default betas (0.9, 0.999)",
        ),
        "eps": dsc.Setting(extra.get("eps", 1e-8), f"{where}(eps=...)" if "eps" in extra else "the default eps 1e-8"),
    }


def _scheduler_values(scheduler, optimizer, divide: int) -> dict[str, dsc.Setting]:
    lr = optimizer.lr if optimizer is not None else getattr(scheduler.optimizer, "defaults", {}).get("lr")
    values = {
        "warmup_min_lr": dsc.Setting(0, "DummyScheduler (warm-up starts at 0)"),
        "warmup_num_steps": dsc.Setting(
            scheduler.warmup_num_steps, f"DummyScheduler(warmup_num_steps={scheduler.warmup_num_steps})"
        ),
    }
    if lr is not None:
        values["warmup_max_lr"] = dsc.Setting(lr, f"the optimizer's lr={lr}")
    if scheduler.total_num_steps is not None:
        steps = math.ceil(scheduler.total_num_steps / divide)
        values["total_num_steps"] = dsc.Setting(
            steps, f"DummyScheduler(total_num_steps={scheduler.total_num_steps}) / {divide} processes"
        )
    return values


__all__ = ["DeepSpeedStrategy"]
