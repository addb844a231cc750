"""Data parallel training with ``torch.nn.parallel.DistributedDataParallel`` (CPU/gloo, CUDA/NCCL, XPU), with
sequence parallelism when a ``ParallelismConfig`` asks for it (hasten's Ulysses: the ``sp`` ranks read the same
batches, each keeps its part of the sequences, and DDP averages the gradients over every rank)."""

from __future__ import annotations

import contextlib

import torch
from torch.nn.parallel import DistributedDataParallel

from ...errors import ConfigError, NotSupportedError
from ...plugins.kwargs import DistributedDataParallelKwargs
from ...runtime.sequence_parallel import sequence_parallel_of, settle_layout
from ..base import Strategy
from .engine import ENGINE


class DDPStrategy(Strategy):
    """Replicates the model on every process and all-reduces gradients in backward.

    Args:
        ddp_kwargs: ``DistributedDataParallelKwargs`` (bucket size, unused parameters, comm hook, ...).
        parallelism_config: a layout with ``sp_size`` (and ``dp_replicate_size``) only: DDP replicates, it does not
            shard; the data-parallel size left unset takes the processes ``sp_size`` leaves.
    """

    replicates_model = True

    @property
    def joins_uneven_inputs(self) -> bool:
        """True (torch's ``Join`` works with DDP) while the job is labelled one of DDP's distributed types; a script
        that relabels it as another engine's (``accelerator.state.distributed_type = DistributedType.FSDP``, as
        Accelerate's own data-loop test does) gets Accelerate's warning and no join."""
        kind = self.state.distributed_type
        return str(getattr(kind, "value", kind)) in ENGINE.distributed_types

    @classmethod
    def build(cls, state, precision, settings, ddp_kwargs=None) -> DDPStrategy:
        """DDP with the script's ``DistributedDataParallelKwargs`` and ``ParallelismConfig``."""
        return cls(
            state, precision, ddp_kwargs=ddp_kwargs, parallelism_config=settings.arguments.get("parallelism_config")
        )

    def __init__(
        self, state, precision, ddp_kwargs: DistributedDataParallelKwargs | None = None, parallelism_config=None
    ):
        super().__init__(state, precision)
        self.ddp_kwargs = ddp_kwargs or DistributedDataParallelKwargs()
        self.distributed_type = state.partial_state.distributed_type
        self.parallelism_config = parallelism_config
        if parallelism_config is not None:
            _replicate_only(parallelism_config, state.num_processes)
            settle_layout(parallelism_config, ENGINE.name, state.device.type)
        self._mesh = None

    @property
    def device_mesh(self):
        """The layout's mesh (``dp_replicate``, ``sp``; None without a ``ParallelismConfig`` or with every size 1)."""
        if self._mesh is None and self.parallelism_config is not None:
            self.state.partial_state.ensure_process_group()
            self._mesh = self.parallelism_config.get_device_mesh(self.device.type)
        return self._mesh

    @property
    def _sequence(self):
        return sequence_parallel_of(self.parallelism_config, self.device_mesh)

    @property
    def data_parallel_world(self) -> tuple[int, int]:
        """(data-parallel size, rank): sequence-parallel peers read the same batches."""
        if self._sequence is None:
            return super().data_parallel_world
        replicas = self.state.num_processes // self.parallelism_config.sp_size
        return replicas, self.state.process_index // self.parallelism_config.sp_size

    def sequence_parallel_loader(self, loader, model: torch.nn.Module | None = None):
        """With sequence parallelism, ``loader`` splitting each batch's sequences over the ``sp`` ranks (whole
        sequences while ``model`` evaluates)."""
        sequence = self._sequence
        if sequence is None:
            return loader
        return sequence.adapt_loader(loader, self.unwrap_model(model) if model is not None else None)

    def gather_for_metrics(self, input_data, use_gather_object: bool = False):
        """As the base strategy; with sequence parallelism, one copy of each sample (the ``sp`` ranks share batches)."""
        if self._sequence is None:
            return super().gather_for_metrics(input_data, use_gather_object)
        from ..tensor_parallel import gather_for_metrics_over_dp

        return gather_for_metrics_over_dp(
            input_data, self.parallelism_config.sp_size, self.gradient_state, use_gather_object
        )

    def setup_model(
        self, model: torch.nn.Module, device_placement: bool = True, evaluation_mode: bool = False
    ) -> torch.nn.Module:
        """Move ``model`` to the device, apply the precision policy and wrap it in DDP (unless evaluating)."""
        if device_placement:
            model = model.to(self.device)
        if self._sequence is not None and not evaluation_mode:
            self._sequence.install(model)
        model = self.precision.wrap_forward(model)
        if (
            evaluation_mode
            or isinstance(model, DistributedDataParallel)
            or not any(p.requires_grad for p in model.parameters())
        ):
            return model
        device_ids = [self.device.index] if self.device.type in ("cuda", "xpu") else None
        ddp = DistributedDataParallel(
            model,
            device_ids=device_ids,
            output_device=device_ids[0] if device_ids else None,
            **self.ddp_kwargs.ddp_kwargs(),
        )
        self.ddp_kwargs.register_comm_hook(ddp)
        return ddp

    def no_sync(self, model: torch.nn.Module):
        """DDP's ``no_sync`` for DDP-wrapped models, nothing otherwise."""
        return model.no_sync() if isinstance(model, DistributedDataParallel) else contextlib.nullcontext()

    @contextlib.contextmanager
    def sync_in_backward(self, model: torch.nn.Module):
        """Re-enable DDP's gradient reduction for the block, even inside ``no_sync``."""
        if not isinstance(model, DistributedDataParallel):
            yield
            return
        previous = model.require_backward_grad_sync
        model.require_backward_grad_sync = True
        model.require_forward_param_sync = True
        model.reducer.prepare_for_backward([])
        try:
            yield
        finally:
            model.require_backward_grad_sync = previous


def _replicate_only(config, world: int) -> None:
    """Refuse what DDP cannot lay out (sharding, tensor or context parallelism) and give an unset data-parallel size
    the processes the sequence split leaves, as replicas."""
    for axis, engine in (("dp_shard", "FSDP2 (fsdp_plugin)"), ("tp", "FSDP2 (fsdp_plugin)"), ("cp", "FSDP2 on CUDA")):
        size = getattr(config, f"{axis}_size") or 1
        if size > 1:
            raise NotSupportedError(
                f"ParallelismConfig({axis}_size={size}) under DDP: DDP replicates whole models. Run it with {engine}, "
                f"or set {axis}_size=1."
            )
    config.dp_shard_size = 1
    split = config.sp_size
    if config.dp_replicate_size == 1 and world % split == 0:
        config.dp_replicate_size = world // split
    if config.dp_replicate_size * split != world:
        raise ConfigError(
            f"ParallelismConfig(dp_replicate_size={config.dp_replicate_size}, sp_size={split}) lays out "
            f"{config.dp_replicate_size * split} processes, but {world} run. Make dp_replicate_size x sp_size equal "
            "the number of processes (--num_processes)."
        )
