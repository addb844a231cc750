"""Kwargs handlers: small dataclasses that customise one torch object the Accelerator creates.

Pass instances in ``Accelerator(kwargs_handlers=[...])``; at most one of each class.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

from ..enums import DDPCommunicationHookType
from ..errors import ConfigError


class KwargsHandler:
    """Base of the handlers: ``to_dict()`` gives every field, ``to_kwargs()`` only those changed from the defaults."""

    def to_dict(self) -> dict[str, Any]:
        """Every attribute as a dict (a deep copy: changing it leaves the handler as it is)."""
        return copy.deepcopy(self.__dict__)

    def to_kwargs(self) -> dict[str, Any]:
        """The fields whose value differs from the class default."""
        default = self.__class__().to_dict()
        return {k: v for k, v in self.to_dict().items() if k not in default or default[k] != v}


@dataclass
class DistributedDataParallelKwargs(KwargsHandler):
    """Arguments of ``torch.nn.parallel.DistributedDataParallel`` and its communication hook."""

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_wrapper: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_state_option: dict = field(default_factory=dict)

    def to_dict(self, ignore_keys=("comm_hook", "comm_wrapper", "comm_state_option")) -> dict[str, Any]:
        """The fields as a dict, without ``ignore_keys`` (by default the hook settings, which DDP itself does not
        take)."""
        return {k: v for k, v in super().to_dict().items() if k not in ignore_keys}

    def ddp_kwargs(self) -> dict[str, Any]:
        """The keyword arguments DDP itself takes (the hook fields excluded)."""
        hook_fields = {"comm_hook", "comm_wrapper", "comm_state_option"}
        return {k: v for k, v in self.to_kwargs().items() if k not in hook_fields}

    def register_comm_hook(self, model) -> None:
        """Register the configured communication hook on a DDP-wrapped ``model``."""
        hook = DDPCommunicationHookType(self.comm_hook)
        if hook == DDPCommunicationHookType.NO:
            return
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        if hook in (DDPCommunicationHookType.FP16, DDPCommunicationHookType.BF16):
            fn = (
                default_hooks.fp16_compress_hook
                if hook == DDPCommunicationHookType.FP16
                else default_hooks.bf16_compress_hook
            )
            model.register_comm_hook(state=None, hook=fn)
            return
        state = powerSGD_hook.PowerSGDState(process_group=None, **self.comm_state_option)
        fn = (
            powerSGD_hook.powerSGD_hook
            if hook == DDPCommunicationHookType.POWER_SGD
            else powerSGD_hook.batched_powerSGD_hook
        )
        wrapper = DDPCommunicationHookType(self.comm_wrapper)
        if wrapper != DDPCommunicationHookType.NO:
            fn = (
                default_hooks.fp16_compress_wrapper
                if wrapper == DDPCommunicationHookType.FP16
                else default_hooks.bf16_compress_wrapper
            )(fn)
        model.register_comm_hook(state=state, hook=fn)


@dataclass
class GradScalerKwargs(KwargsHandler):
    """Arguments of the fp16 ``torch.amp.GradScaler``."""

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True


@dataclass
class InitProcessGroupKwargs(KwargsHandler):
    """Arguments of ``torch.distributed.init_process_group``.

    ``backend`` defaults to nccl as in Accelerate; on CPU processes hasten uses gloo whatever is given
    here. ``timeout`` bounds how long a collective may wait before the job fails; left unset it becomes
    torch's default for the backend, as in Accelerate (10 minutes for nccl, 30 for the others), so that
    ``to_kwargs()`` holds it only when it differs from nccl's. A number is taken as seconds.
    """

    backend: str | None = "nccl"
    init_method: str | None = None
    timeout: timedelta | None = None

    def __post_init__(self):
        if self.timeout is None:
            self.timeout = timedelta(seconds=600 if self.backend == "nccl" else 1800)
        if isinstance(self.timeout, (int, float)):
            self.timeout = timedelta(seconds=self.timeout)
        if not isinstance(self.timeout, timedelta):
            raise ConfigError(
                f"InitProcessGroupKwargs(timeout={self.timeout!r}): give a datetime.timedelta or seconds."
            )


@dataclass
class AutocastKwargs(KwargsHandler):
    """Arguments of ``torch.autocast`` used by ``Accelerator.autocast()`` and prepared models.

    Args:
        enabled, cache_enabled: as ``torch.autocast``'s.
        convert_outputs_to_fp32: True (Accelerate's behaviour): a prepared model's fp16/bf16 outputs come back
            converted to fp32. False (hasten only): they stay in the autocast dtype, which saves the fp32 copy of
            every output (for a language model, the logits: batch x sequence x vocabulary x 4 bytes) and the two
            conversion passes per step. The loss is then computed from half-precision values: compute it under
            ``with accelerator.autocast():``, where torch runs the loss functions (``cross_entropy``,
            ``log_softmax``, ``mse_loss``, ...) in fp32 as a raw autocast loop does; computed outside autocast it
            runs in fp16/bf16 (less precise; fp16 may overflow).
    """

    enabled: bool = True
    cache_enabled: bool | None = None
    convert_outputs_to_fp32: bool = True

    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict; ``convert_outputs_to_fp32`` only where it was turned off, so that a handler written
        for Accelerate gives Accelerate's dict."""
        fields = super().to_dict()
        if fields["convert_outputs_to_fp32"]:
            del fields["convert_outputs_to_fp32"]
        return fields

    def autocast_kwargs(self) -> dict[str, Any]:
        """The keyword arguments ``torch.autocast`` takes: the changed fields, without ``convert_outputs_to_fp32``."""
        return {k: v for k, v in self.to_kwargs().items() if k != "convert_outputs_to_fp32"}


@dataclass
class ProfileKwargs(KwargsHandler):
    """Arguments of ``torch.profiler.profile`` used by ``Accelerator.profile()``.

    ``activities`` is a list of ``"cpu"``/``"cuda"``/``"xpu"``; ``schedule_option`` a dict of
    ``torch.profiler.schedule`` arguments (wait, warmup, active, repeat, skip_first);
    ``output_trace_dir`` makes each process write a Chrome trace there.
    """

    activities: list[str] | None = None
    schedule_option: dict[str, int] | None = None
    on_trace_ready: Callable | None = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    with_modules: bool = False
    output_trace_dir: str | None = None

    def build(self):
        """Create the configured ``torch.profiler.profile`` object."""
        import torch.profiler as tp

        names = {"cpu": tp.ProfilerActivity.CPU, "cuda": tp.ProfilerActivity.CUDA}
        if hasattr(tp.ProfilerActivity, "XPU"):
            names["xpu"] = tp.ProfilerActivity.XPU
        activities = None
        if self.activities is not None:
            unknown = [a for a in self.activities if a not in names]
            if unknown:
                raise ConfigError(f"ProfileKwargs(activities=...): unknown {unknown}; choose from {sorted(names)}.")
            activities = [names[a] for a in self.activities]
        schedule = tp.schedule(**self.schedule_option) if self.schedule_option else None
        return tp.profile(
            activities=activities,
            schedule=schedule,
            on_trace_ready=self.on_trace_ready,
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
            with_flops=self.with_flops,
            with_modules=self.with_modules,
        )
