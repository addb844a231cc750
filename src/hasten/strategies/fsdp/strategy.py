"""Fully sharded data parallel training with PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``).

Each process keeps a shard (a ``DTensor``) of every parameter, gradient and optimizer state;
parameters are all-gathered per wrapped module for its forward and backward, and gradients are
reduce-scattered. ``fully_shard`` works in place: the prepared model is the user's model (its class
becomes a subclass that also derives from ``FSDPModule``), with the same parameter names.
"""

from __future__ import annotations

import contextlib
from typing import Iterable

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from ...enums import DistributedType
from ...errors import CheckpointError, ConfigError
from ...runtime.compilation import compile_regions_fsdp2, compile_settings
from ...runtime.parallelism import data_parallel_mesh
from ...runtime.sequence_parallel import sequence_parallel_of, settle_layout
from ...runtime.wrappers import is_compiled_module
from ..base import Strategy
from . import checkpoint as fsdp_checkpoint
from . import layout, wrapping
from .checkpoint import sharded_root
from .plugin import FullyShardedDataParallelPlugin


def _on_meta(module: torch.nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def _is_distributed(module: torch.nn.Module) -> bool:
    """Whether ``module``'s parameters already are DTensors (it was prepared: sharded or split over ``tp``)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


def _copies(grad, world: int) -> int:
    """How many processes hold each element of a DTensor's local piece: its replicated mesh dimensions, and
    every process outside its mesh (a parameter sharded over ``dp`` only is whole on each ``tp`` peer)."""
    mesh = grad.device_mesh
    count = world // mesh.size()
    for dim, placement in enumerate(grad.placements):
        if placement.is_replicate():
            count *= mesh.size(dim)
        elif placement.is_partial():
            raise NotImplementedError("clip_grad_norm_ got a partial (not yet reduced) gradient")
    return count


def _prepared_root(model) -> torch.nn.Module | None:
    """The prepared module of ``model`` (FSDP-sharded, or split over ``tp`` only), or None."""
    inner = model._orig_mod if is_compiled_module(model) else model
    return sharded_root(model) or (inner if _is_distributed(inner) else None)


class FSDPStrategy(Strategy):
    """Shards models with FSDP2 as a :class:`~hasten.strategies.fsdp.plugin.FullyShardedDataParallelPlugin` says.

    With a :class:`~hasten.runtime.parallelism.ParallelismConfig` the mesh is the config's (its axes above 1 of
    ``dp_replicate``, ``dp_shard``, ``cp``, ``sp``, ``tp``): models are first split over ``tp`` as their
    tensor-parallel plan says, then sharded over the data-parallel ranks (not at all when there is one data-parallel
    rank) and the ``sp``/``cp`` ranks, which hold parts of the same sequences (hasten's Ulysses attention splits them
    over ``sp``, torch's ring attention over ``cp``).

    Args:
        fsdp_plugin: the settings (wrapping, resharding, offload, precision policy, state dict type, ...).
        parallelism_config: the N-D layout (None: the plugin's sharding strategy decides the mesh).
    """

    distributed_type = DistributedType.FSDP

    @classmethod
    def build(cls, state, precision, settings, ddp_kwargs=None) -> FSDPStrategy:
        """FSDP2 (and tensor parallelism) for the settled plugin and ``ParallelismConfig``."""
        return cls(state, precision, settings.plugin, parallelism_config=settings.arguments.get("parallelism_config"))

    def __init__(self, state, precision, fsdp_plugin: FullyShardedDataParallelPlugin, parallelism_config=None):
        super().__init__(state, precision)
        settle_layout(parallelism_config, "fsdp", state.device.type)
        self.parallelism_config = parallelism_config
        if not isinstance(fsdp_plugin, FullyShardedDataParallelPlugin):
            raise ConfigError(
                f"fsdp_plugin must be a hasten FullyShardedDataParallelPlugin, got {type(fsdp_plugin).__name__}."
            )
        self.plugin = fsdp_plugin
        fsdp_plugin.set_mixed_precision(precision.mixed_precision)
        self._mesh = None
        # parameters of models before sharding -> (model, name), to rebind optimizers built on them
        self._origins = WeakIdKeyDictionary()
        # the sharded parameters of every model this strategy prepared (optimizers may be built on them)
        self._sharded = WeakIdKeyDictionary()
        self._unsynced: set[int] = set()

    # ---------------------------------------------------------------------------------- the mesh

    @property
    def device_mesh(self):
        """The device mesh parameters are sharded over: 1-D (``dp_shard``), or 2-D (``dp_replicate``,
        ``dp_shard``) for ``HYBRID_SHARD``/``HYBRID_SHARD_ZERO2`` (shard within a machine) and ``NO_SHARD``
        (replicate everywhere)."""
        if self._mesh is None:
            self._mesh = self._build_mesh()
        return self._mesh

    @property
    def _shard_mesh(self):
        """The mesh ``fully_shard`` shards over: the data-parallel dimensions (None with one data-parallel rank)."""
        mesh = self.device_mesh
        if self.parallelism_config is None:
            return mesh
        return layout.shard_mesh(self.parallelism_config, mesh)

    @property
    def data_parallel_world(self) -> tuple[int, int]:
        """(data-parallel size, this process's data-parallel rank): tensor-parallel peers read the same batches."""
        if self.parallelism_config is None:
            return super().data_parallel_world
        dp = data_parallel_mesh(self.device_mesh)
        return (1, 0) if dp is None else (dp.size(), dp.get_local_rank())

    def gather_for_metrics(self, input_data, use_gather_object: bool = False):
        """As the base strategy; with tensor or sequence parallelism, one copy of each sample (the ``tp``, ``sp`` and
        ``cp`` peers share batches)."""
        if self.parallelism_config is None or self.parallelism_config.non_data_parallel_size == 1:
            return super().gather_for_metrics(input_data, use_gather_object)
        from ..tensor_parallel import gather_for_metrics_over_dp

        copies = self.parallelism_config.non_data_parallel_size
        return gather_for_metrics_over_dp(input_data, copies, self.gradient_state, use_gather_object)

    def sequence_parallel_loader(self, loader, model: torch.nn.Module | None = None):
        """With sequence parallelism (``sp``), ``loader`` splitting each batch's sequences over the ``sp`` ranks
        (whole sequences while ``model`` evaluates)."""
        sequence = sequence_parallel_of(self.parallelism_config, self.device_mesh)
        return loader if sequence is None else sequence.adapt_loader(loader, model)

    def context_parallel(self, buffers=None, buffer_seq_dims=None, no_restore_buffers=None):
        """torch's ``context_parallel`` over the ``cp`` ranks (CUDA), for ``accelerator.maybe_context_parallel``."""
        if self.parallelism_config is None or not self.parallelism_config.cp_enabled:
            return super().context_parallel(buffers, buffer_seq_dims, no_restore_buffers)
        return layout.context_parallel(
            self.parallelism_config, self.device_mesh, buffers, buffer_seq_dims, no_restore_buffers
        )

    def _build_mesh(self):
        from torch.distributed.device_mesh import init_device_mesh

        self.state.partial_state.ensure_process_group()
        world = self.state.num_processes
        if self.parallelism_config is not None:
            self._check_layout(world)
            return self.parallelism_config.build_device_mesh(self.device.type)
        strategy = self.plugin.sharding_strategy
        device_type = self.device.type
        if strategy == "NO_SHARD":
            return init_device_mesh(device_type, (world, 1), mesh_dim_names=("dp_replicate", "dp_shard"))
        if strategy.startswith("HYBRID"):
            machines = max(self.state.num_machines, 1)
            if world % machines:
                raise ConfigError(
                    f"sharding_strategy={strategy!r} needs the same number of processes on each machine; got {world} "
                    f"processes on {machines} machines."
                )
            return init_device_mesh(
                device_type, (machines, world // machines), mesh_dim_names=("dp_replicate", "dp_shard")
            )
        return init_device_mesh(device_type, (world,), mesh_dim_names=("dp_shard",))

    def _check_layout(self, world: int) -> None:
        """The ``ParallelismConfig`` must lay out exactly ``world`` processes and leave FSDP a shard dimension."""
        config = self.parallelism_config
        sizes = config.sizes(world)
        if sizes["dp_replicate"] > 1 and sizes["dp_shard"] == 1 and not config.sequence_dim_names:
            raise ConfigError(
                f"ParallelismConfig(dp_replicate_size={sizes['dp_replicate']}, dp_shard_size=1): FSDP has no dimension "
                "to shard over. Set dp_shard_size > 1 (HSDP), or train without a ParallelismConfig and FSDP plugin "
                "(DDP) to replicate the whole model."
            )

    # ---------------------------------------------------------------------------------- preparing

    def setup_model(
        self, model: torch.nn.Module, device_placement: bool = True, evaluation_mode: bool = False
    ) -> torch.nn.Module:
        """Shard ``model`` in place with ``fully_shard`` (wrapped layers first, then the root); return it.

        Models already sharded are returned as given. With ``evaluation_mode`` the model is only placed
        and given the precision policy. Parameters on the meta device are materialised and filled with
        process 0's weights when ``sync_module_states``/``cpu_ram_efficient_loading`` is set.
        """
        inner = model._orig_mod if is_compiled_module(model) else model
        if sharded_root(model) is not None or _is_distributed(inner):
            return model
        if device_placement and not _on_meta(inner):
            inner.to(self.device)
        # recorded before the precision policy runs: fp8's float8 all-gather replaces weights (names stay)
        for name, parameter in inner.named_parameters():
            self._origins[parameter] = (inner, name)
        gathers = not evaluation_mode and self._shard_mesh is not None and self._shard_mesh.size(-1) > 1
        self.precision.wrap_forward(inner, sharded=gathers)
        if evaluation_mode:
            return model
        source = self._weights_to_broadcast(inner)
        layout.split_sequences(self.parallelism_config, self.device_mesh, inner)
        if self.parallelism_config is not None and self.parallelism_config.tp_enabled:
            from ..tensor_parallel import apply_tensor_parallel

            apply_tensor_parallel(inner, self.device_mesh["tp"])
        if self._shard_mesh is not None:
            self._shard(inner)
        self._materialize(inner, source)
        for parameter in inner.parameters():
            self._sharded[parameter] = True
        return model

    def compile_model(self, model: torch.nn.Module, dynamo_plugin) -> torch.nn.Module:
        """As the base strategy (the sharded model, whole or by region in place); compiling regions also turns on
        dynamo's ``capture_scalar_outputs`` and ``skip_fwd_side_effects_in_bwd_under_checkpoint`` for the process, as
        Accelerate does under FSDP2 (torchtitan's recipe for compiled blocks: data-dependent shapes such as MoE
        routing, and no replay of forward side effects when checkpointed blocks recompute)."""
        kwargs = compile_settings(model, dynamo_plugin)
        if kwargs is None or not dynamo_plugin.use_regional_compilation:
            return super().compile_model(model, dynamo_plugin)
        torch._dynamo.config.capture_scalar_outputs = True
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
        return compile_regions_fsdp2(model, **kwargs)

    def _weights_to_broadcast(self, model: torch.nn.Module) -> dict | None:
        """Process 0's full state dict when its weights are broadcast at setup (``{}`` on other processes)."""
        if not self.plugin.sync_module_states:
            return None
        if self.state.process_index != 0:
            return {}
        if _on_meta(model):
            raise ConfigError(
                "cpu_ram_efficient_loading / sync_module_states broadcasts process 0's weights, but process 0's model "
                "has parameters on the meta device. Load the real weights on process 0 (other processes may use the "
                "meta device)."
            )
        return model.state_dict()

    def _shard(self, model: torch.nn.Module) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        plugin = self.plugin
        targets = wrapping.wrap_targets(plugin, model)
        if plugin.activation_checkpointing:
            if not targets:
                raise ConfigError(
                    "activation_checkpointing=True checkpoints the modules the auto wrap policy selects, and it "
                    "selects none. Set auto_wrap_policy='TRANSFORMER_BASED_WRAP' with transformer_cls_names_to_wrap "
                    "(or SIZE_BASED_WRAP)."
                )
            from torch.distributed._composable import checkpoint

            for target in targets:
                checkpoint(target)
        options = {
            "mesh": self._shard_mesh,
            "mp_policy": plugin.mixed_precision_policy or MixedPrecisionPolicy(),
            "offload_policy": self._offload_policy(),
            "ignored_params": wrapping.ignored_parameters(plugin, model) or None,
        }
        for target in targets:
            fully_shard(target, reshard_after_forward=plugin.reshard_after_forward, **options)
        # With wrapped layers the root keeps its own (small) parameters gathered from forward to backward.
        root_reshard = None if targets and plugin.reshard_after_forward is True else plugin.reshard_after_forward
        fully_shard(model, reshard_after_forward=root_reshard, **options)
        if plugin.forward_prefetch:
            for current, following in zip(targets, targets[1:]):
                current.set_modules_to_forward_prefetch([following])

    def _offload_policy(self):
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

        offload = self.plugin.cpu_offload
        if isinstance(offload, OffloadPolicy):
            return offload
        return CPUOffloadPolicy(pin_memory=self.device.type == "cuda") if offload else OffloadPolicy()

    def _materialize(self, model: torch.nn.Module, source: dict | None) -> None:
        if _on_meta(model):
            if source is None:
                raise ConfigError(
                    "The model has parameters on the meta device and nothing fills them. Set "
                    "cpu_ram_efficient_loading=True (FSDP_CPU_RAM_EFFICIENT_LOADING=1) with the real weights loaded on "
                    "process 0, or load the weights before prepare()."
                )
            model.to_empty(device=self.device)
        if source is None:
            return
        fsdp_checkpoint.load_full_model_state(model, source)
        from torch.distributed.tensor import DTensor

        for buffer in model.buffers():
            if not isinstance(buffer, DTensor):
                dist.broadcast(buffer, src=0)

    def setup_optimizer(
        self, optimizer: torch.optim.Optimizer, originals: list, prepared: list
    ) -> torch.optim.Optimizer:
        """Point an optimizer built on the unsharded model at the sharded parameters (matched by name).

        ``fully_shard`` replaces every parameter with a sharded one; an optimizer that still held the
        old tensors would update copies the model no longer uses. Parameters that already are sharded
        ones (the optimizer was built from a model prepared earlier) are kept as they are. Parameters
        that belong to no model sharded by this strategy are a :class:`~hasten.errors.ConfigError`.
        """
        live = {id(p) for model in prepared for p in model.parameters()}
        rebound = [
            [self._sharded_parameter(optimizer, p, g, i, live) for i, p in enumerate(group["params"])]
            for g, group in enumerate(optimizer.param_groups)
        ]
        for group, params in zip(optimizer.param_groups, rebound):
            group["params"] = params
        self.precision.attach_optimizer(optimizer, prepared)
        return optimizer

    def _sharded_parameter(self, optimizer, parameter, group_index: int, index: int, live: set[int]):
        if id(parameter) in live or parameter in self._sharded:
            return parameter
        origin = self._origins.get(parameter)
        if origin is None:
            raise ConfigError(
                f"The optimizer's parameter {index} of group {group_index} (shape {tuple(parameter.shape)}) belongs to "
                "no model prepared with FSDP. Build the optimizer from model.parameters() of the model you pass to "
                "prepare(), and prepare that model in the same call or before the optimizer."
            )
        if optimizer.state.get(parameter):
            raise ConfigError(
                "The optimizer already holds state (it has stepped) for parameters of the unsharded model, which FSDP "
                "cannot shard. Create the optimizer fresh and pass it to prepare() before training; restore state with "
                "load_state()."
            )
        module, name = origin
        return module.get_parameter(name)

    # ---------------------------------------------------------------------------------- training

    @contextlib.contextmanager
    def no_sync(self, model: torch.nn.Module):
        """Skip the gradient reduce-scatter in the block's backward passes; gradients accumulate unsharded."""
        root = sharded_root(model)
        if root is None:
            yield
            return
        root.set_requires_gradient_sync(False)
        self._unsynced.add(id(root))
        try:
            yield
        finally:
            self._unsynced.discard(id(root))
            root.set_requires_gradient_sync(True)

    @contextlib.contextmanager
    def sync_in_backward(self, model: torch.nn.Module):
        """Reduce gradients in the block's backward, even inside :meth:`no_sync`."""
        root = sharded_root(model)
        if root is None:
            yield
            return
        root.set_requires_gradient_sync(True)
        try:
            yield
        finally:
            root.set_requires_gradient_sync(id(root) not in self._unsynced)

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """Clip to a global norm over the gradients of all processes; return the norm before clipping.

        Gradients may be sharded over ``dp_shard``, split over ``tp``, or whole (the same on every
        process): each process adds the ``norm_type``-th powers of its local pieces, counting a piece
        that ``k`` processes hold ``1/k`` times, and one all-reduce gives the total. The norm equals
        DDP's on the same gradients (up to float rounding), and is a plain tensor.
        """
        from torch.distributed.tensor import DTensor

        parameters = [p for p in parameters if p.grad is not None]
        if not parameters:
            return torch.zeros((), device=self.device)
        infinite = float(norm_type) == float("inf")
        distributed = any(isinstance(p.grad, DTensor) for p in parameters)
        world = self.state.num_processes if distributed else 1
        pieces, layouts = {}, {}
        for p in parameters:
            grad = p.grad
            local, copies = (
                (grad.to_local(), _copies(grad, self.state.num_processes))
                if isinstance(grad, DTensor)
                else (grad, world)
            )
            pieces.setdefault(copies, []).append(local)
            key = (id(grad.device_mesh), tuple(grad.placements)) if isinstance(grad, DTensor) else None
            layouts.setdefault(key, []).append(p)
        parts = []
        for copies, tensors in pieces.items():
            norm = torch.nn.utils.get_total_norm(tensors, norm_type).to(self.device, torch.float32)
            parts.append(norm if infinite else norm.pow(norm_type) / copies)
        total = torch.stack(parts).max() if infinite else torch.stack(parts).sum()
        if distributed:
            dist.all_reduce(total, op=dist.ReduceOp.MAX if infinite else dist.ReduceOp.SUM)
        if not infinite:
            total = total.pow(1.0 / norm_type)
        for group in layouts.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
        return total

    # ---------------------------------------------------------------------------------- state

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
        """The full state dict gathered on process 0, on the CPU (an empty dict on other processes).

        Keys are the model's own parameter names (FSDP2 adds no prefix, and compile's ``_orig_mod.`` is
        never included).
        """
        root = _prepared_root(model)
        if root is None:
            return super().get_state_dict(model, unwrap=unwrap)
        return fsdp_checkpoint.full_model_state(root)

    def save_checkpoint(self, writer, models: list, optimizers: list) -> None:
        """Write models and optimizers: per-process shards with ``SHARDED_STATE_DICT``, gathered on process 0 with
        ``FULL_STATE_DICT``."""
        if writer.is_main != (self.state.process_index == 0):
            raise CheckpointError(
                "save_on_each_node is not supported with FSDP: a checkpoint needs the shards (or the gathered state) "
                "of all processes in one folder. Save to a filesystem every machine shares, with "
                "ProjectConfiguration(save_on_each_node=False)."
            )
        sharded = self.plugin.state_dict_type == "SHARDED_STATE_DICT"
        for index, model in enumerate(models):
            fsdp_checkpoint.save_model(writer, model, index, sharded, self.get_state_dict)
        for index, optimizer in enumerate(optimizers):
            fsdp_checkpoint.save_optimizer(writer, fsdp_checkpoint.owner(models, optimizer), optimizer, index, sharded)

    def load_checkpoint(self, reader, models: list, optimizers: list) -> None:
        """Restore what :meth:`save_checkpoint` wrote, sharded or full (whichever the checkpoint holds), onto any number
        of processes; a checkpoint of another engine (one process, DDP, DeepSpeed ZeRO) by parameter name
        (:mod:`.other_engines`)."""
        from .other_engines import resume_by_name

        if resume_by_name(self, reader, models, optimizers):
            return
        for index, model in enumerate(models):
            fsdp_checkpoint.load_model(reader, model, index)
        for index, optimizer in enumerate(optimizers):
            fsdp_checkpoint.load_optimizer(reader, fsdp_checkpoint.owner(models, optimizer), optimizer, index)
