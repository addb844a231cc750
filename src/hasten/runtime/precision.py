"""Mixed precision: the autocast policy, the fp16 gradient scaler, and the forward wrapper of prepared models.

``mixed_precision="fp16"`` or ``"bf16"`` runs prepared models' forward under ``torch.autocast`` (CUDA,
XPU, MPS and CPU) and converts their outputs back to fp32; fp16 also scales the loss with a
``torch.amp.GradScaler`` and skips optimizer steps whose gradients overflowed. ``"fp8"`` needs an fp8
backend (torchao) and hardware with fp8 units (CUDA compute capability 8.9+); elsewhere it is refused
with an error that says what is missing.
"""

from __future__ import annotations

import contextlib
import importlib.util

import torch

from ..errors import ConfigError, MissingDependencyError
from .tree import convert_to_fp32
from ..plugins.kwargs import AutocastKwargs, GradScalerKwargs

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


class AutocastForward:
    """A model's forward run under autocast, with half-precision outputs converted back to fp32."""

    def __init__(self, forward, device_type: str, dtype: torch.dtype, cache_enabled: bool | None, to_fp32: bool = True):
        self.original_forward = forward
        self.device_type = device_type
        self.dtype = dtype
        self.cache_enabled = cache_enabled
        self.to_fp32 = to_fp32
        self.__wrapped__ = forward

    def __call__(self, *args, **kwargs):
        options = {} if self.cache_enabled is None else {"cache_enabled": self.cache_enabled}
        with torch.autocast(device_type=self.device_type, dtype=self.dtype, **options):
            output = self.original_forward(*args, **kwargs)
        return convert_to_fp32(output) if self.to_fp32 else output


def _fp8_check(device: torch.device) -> None:
    if device.type != "cuda":
        raise ConfigError(
            f"mixed_precision='fp8' needs a GPU with fp8 units (NVIDIA compute capability 8.9+, e.g. H100); this "
            f"process runs on {device}. Use 'bf16' (or 'fp16') instead."
        )
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise ConfigError(f"mixed_precision='fp8' needs compute capability 8.9+, this GPU has {major}.{minor}. Use 'bf16'.")
    if importlib.util.find_spec("torchao") is None:
        raise MissingDependencyError("mixed_precision='fp8' needs torchao's float8 training. Install it with: pip install torchao")


class Precision:
    """The precision policy of one Accelerator.

    Args:
        mixed_precision: ``"no"``, ``"fp16"``, ``"bf16"`` or ``"fp8"``.
        device: the process's device (autocast runs on its type).
        autocast_kwargs: defaults of :meth:`autocast`.
        scaler_kwargs: settings of the fp16 gradient scaler.
    """

    def __init__(self, mixed_precision: str, device: torch.device, autocast_kwargs: AutocastKwargs | None = None, scaler_kwargs: GradScalerKwargs | None = None):
        self.mixed_precision = mixed_precision
        self.device = device
        self.autocast_kwargs = autocast_kwargs or AutocastKwargs()
        if mixed_precision == "fp8":
            _fp8_check(device)
        # fp8 computes matmuls in fp8 and the rest in bf16.
        self.dtype = _DTYPES.get("bf16" if mixed_precision == "fp8" else mixed_precision)
        self.scaler = None
        if mixed_precision == "fp16":
            kwargs = (scaler_kwargs or GradScalerKwargs()).to_dict()
            self.scaler = torch.amp.GradScaler(device.type, **kwargs)

    @property
    def enabled(self) -> bool:
        """True when autocast is in use."""
        return self.dtype is not None

    def autocast(self, autocast_handler: AutocastKwargs | None = None):
        """Context manager running its block under this policy's autocast (no-op without mixed precision)."""
        handler = autocast_handler or self.autocast_kwargs
        if not self.enabled or not handler.enabled:
            return contextlib.nullcontext()
        options = {} if handler.cache_enabled is None else {"cache_enabled": handler.cache_enabled}
        return torch.autocast(device_type=self.device.type, dtype=self.dtype, **options)

    def wrap_forward(self, model: torch.nn.Module) -> torch.nn.Module:
        """Make ``model.forward`` run under autocast and return fp32 outputs (idempotent)."""
        if not self.enabled or not self.autocast_kwargs.enabled or isinstance(model.__dict__.get("forward"), AutocastForward):
            return model
        if self.mixed_precision == "fp8":
            from torchao.float8 import convert_to_float8_training

            convert_to_float8_training(model)
        model.forward = AutocastForward(model.forward, self.device.type, self.dtype, self.autocast_kwargs.cache_enabled)
        return model

    @staticmethod
    def unwrap_forward(model: torch.nn.Module) -> torch.nn.Module:
        """Undo :meth:`wrap_forward`."""
        forward = model.__dict__.get("forward")
        if isinstance(forward, AutocastForward):
            del model.forward
            if model.forward != forward.original_forward:
                model.forward = forward.original_forward
        return model

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """``loss.backward()``, scaled first under fp16."""
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward(**kwargs)
