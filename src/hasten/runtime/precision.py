"""Mixed precision: the autocast policy, the fp16 gradient scaler, and the forward wrapper of prepared models.

``mixed_precision="fp16"`` or ``"bf16"`` runs prepared models' forward under ``torch.autocast`` (CUDA, XPU, MPS and
CPU) and, as Accelerate does, converts their half-precision outputs back to fp32 (``AutocastKwargs(
convert_outputs_to_fp32=False)`` keeps them in the autocast dtype); fp16 also scales the loss with a
``torch.amp.GradScaler`` and skips optimizer steps whose gradients overflowed. ``"fp8"`` is bf16 autocast plus
torchao's float8 linear layers (:mod:`hasten.runtime.float8`), checked when the policy is built: torchao
installed, a device that multiplies float8 matrices (or torchao's emulation), a backend hasten supports.

The conversion to fp32 is one ``Tensor.float()`` per half-precision output: its backward keeps no tensor, so
autograd holds no copy for it; what it costs is the fp32 copy itself (held by whoever holds the output) and one
pass over the outputs each way.
"""

from __future__ import annotations

import contextlib

import torch

from ..plugins.kwargs import AutocastKwargs, GradScalerKwargs
from .float8 import float8_training
from .tree import convert_to_fp32

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
_HALF = (torch.float16, torch.bfloat16)


class AutocastForward:
    """A model's forward run under autocast, with half-precision outputs converted back to fp32 (unless ``to_fp32``
    is False)."""

    def __init__(self, forward, device_type: str, dtype: torch.dtype, cache_enabled: bool | None, to_fp32: bool = True):
        self.original_forward = forward
        self.device_type = device_type
        self.dtype = dtype
        self.cache_enabled = cache_enabled
        self.to_fp32 = to_fp32
        self.__wrapped__ = forward
        self._options = {"device_type": device_type, "dtype": dtype}
        if cache_enabled is not None:
            self._options["cache_enabled"] = cache_enabled

    def __call__(self, *args, **kwargs):
        with torch.autocast(**self._options):
            output = self.original_forward(*args, **kwargs)
        if not self.to_fp32:
            return output
        if type(output) is torch.Tensor:  # the common case, without the walk over a structure
            return output.float() if output.dtype in _HALF else output
        return convert_to_fp32(output)


class Precision:
    """The precision policy of one Accelerator.

    Args:
        mixed_precision: ``"no"``, ``"fp16"``, ``"bf16"`` or ``"fp8"``.
        device: the process's device (autocast runs on its type).
        autocast_kwargs: defaults of :meth:`autocast`, and whether prepared models' outputs become fp32.
        scaler_kwargs: settings of the fp16 gradient scaler.
        fp8_recipe: the ``AORecipeKwargs`` / ``FP8RecipeKwargs`` given (only with ``"fp8"``; None: the defaults).
    """

    def __init__(
        self,
        mixed_precision: str,
        device: torch.device,
        autocast_kwargs: AutocastKwargs | None = None,
        scaler_kwargs: GradScalerKwargs | None = None,
        fp8_recipe=None,
    ):
        self.mixed_precision = mixed_precision
        self.device = device
        self.autocast_kwargs = autocast_kwargs or AutocastKwargs()
        self.float8 = float8_training(mixed_precision, fp8_recipe, device)
        # fp8 computes the float8 layers' matmuls in fp8 and the rest in bf16.
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

    def wrap_forward(self, model: torch.nn.Module, sharded: bool = False) -> torch.nn.Module:
        """Apply the policy to ``model`` in place (idempotent): under fp8 convert its linear layers to float8 ones,
        then make its forward run under autocast and, unless ``AutocastKwargs.convert_outputs_to_fp32`` is False,
        return fp32 outputs.

        Args:
            sharded: FSDP will shard ``model`` over several processes (so fp8 weights may be all-gathered in float8,
                as the recipe says).
        """
        if self.float8 is not None:
            self.float8.convert(model, sharded=sharded)
        if (
            not self.enabled
            or not self.autocast_kwargs.enabled
            or isinstance(model.__dict__.get("forward"), AutocastForward)
        ):
            return model
        handler = self.autocast_kwargs
        to_fp32 = handler.convert_outputs_to_fp32
        model.forward = AutocastForward(model.forward, self.device.type, self.dtype, handler.cache_enabled, to_fp32)
        return model

    def attach_optimizer(self, optimizer: torch.optim.Optimizer, models: list) -> None:
        """Let the policy follow ``optimizer``'s steps; under fp8 with FSDP's float8 all-gather, the float8 scales of
        the sharded weights of ``models`` are precomputed after each step (a no-op otherwise)."""
        if self.float8 is not None:
            self.float8.attach_optimizer(optimizer, models)

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
