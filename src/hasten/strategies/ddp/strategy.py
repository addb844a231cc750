"""Data parallel training with ``torch.nn.parallel.DistributedDataParallel`` (CPU/gloo, CUDA/NCCL, XPU)."""

from __future__ import annotations

import contextlib

import torch
from torch.nn.parallel import DistributedDataParallel

from ...plugins.kwargs import DistributedDataParallelKwargs
from ..base import Strategy
from .engine import ENGINE


class DDPStrategy(Strategy):
    """Replicates the model on every process and all-reduces gradients in backward.

    Args:
        ddp_kwargs: ``DistributedDataParallelKwargs`` (bucket size, unused parameters, comm hook, ...).
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
        """DDP with the script's ``DistributedDataParallelKwargs``."""
        return cls(state, precision, ddp_kwargs=ddp_kwargs)

    def __init__(self, state, precision, ddp_kwargs: DistributedDataParallelKwargs | None = None):
        super().__init__(state, precision)
        self.ddp_kwargs = ddp_kwargs or DistributedDataParallelKwargs()
        self.distributed_type = state.partial_state.distributed_type

    def setup_model(
        self, model: torch.nn.Module, device_placement: bool = True, evaluation_mode: bool = False
    ) -> torch.nn.Module:
        """Move ``model`` to the device, apply the precision policy and wrap it in DDP (unless evaluating)."""
        if device_placement:
            model = model.to(self.device)
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
