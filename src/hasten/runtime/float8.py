"""fp8 training through torchao: which linear layers become float8 ones, the device check, the FSDP2 hook.

``mixed_precision="fp8"`` is bf16 autocast plus torchao's float8 linear layers: :class:`Float8Training` converts a
model's ``nn.Linear`` layers with ``torchao.float8.convert_to_float8_training`` when a strategy sets the model up
(before DDP wraps it or FSDP2 shards it, so that FSDP can all-gather the float8 weights), keeping in high
precision, as Accelerate does, the model's first and last linear layers (converting them tends to destabilise
training) and any layer whose sizes are not multiples of 16 (the float8 matmul needs them). torchao is imported
only here, only when fp8 is asked for.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from .. import environment
from ..errors import ConfigError
from ..plugins.fp8 import AORecipeKwargs, require_torchao
from ..settings.fp8 import FP8, unsupported_backend

ModuleFilter = Callable[[torch.nn.Module, str], bool]


def first_and_last_linear(model: torch.nn.Module) -> tuple[str | None, str | None]:
    """The qualified names of the first and the last ``nn.Linear`` of ``model`` (None, None without any)."""
    names = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    return (names[0], names[-1]) if names else (None, None)


def fp8_eligible(module: torch.nn.Module, fqn: str, keep_in_high_precision) -> bool:
    """False for an ``nn.Linear`` whose sizes are not multiples of 16, and for the names in
    ``keep_in_high_precision``; True otherwise."""
    if isinstance(module, torch.nn.Linear) and (module.in_features % 16 or module.out_features % 16):
        return False
    return fqn not in keep_in_high_precision


def default_module_filter(model: torch.nn.Module) -> ModuleFilter:
    """The filter Accelerate applies when none is given: every linear layer but ``model``'s first and last ones."""
    kept = set(first_and_last_linear(model))
    return lambda module, fqn: fp8_eligible(module, fqn, kept)


def check_fp8_device(device: torch.device) -> None:
    """Raise :class:`~hasten.errors.ConfigError` unless ``device`` multiplies float8 matrices (``torch._scaled_mm``).

    One 16x16 product of ``float8_e4m3fn`` matrices is tried on the device, so the answer is the device's own (NVIDIA
    compute capability 8.9+, a CPU build of torch with float8 matmuls); torchao's emulation mode needs none of this.
    """
    a = torch.zeros(16, 16, device=device).to(torch.float8_e4m3fn)
    b = torch.zeros(16, 16, device=device).to(torch.float8_e4m3fn).t()
    scale = torch.ones((), device=device)
    try:
        torch._scaled_mm(a, b, scale_a=scale, scale_b=scale, out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError, TypeError) as error:
        what = str(device)
        if device.type == "cuda":
            major, minor = torch.cuda.get_device_capability(device)
            name = torch.cuda.get_device_name(device)
            what = f"{name} (compute capability {major}.{minor}; fp8 needs 8.9+, e.g. L4, H100)"
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ConfigError(
            f"mixed_precision='fp8' needs float8 matrix multiplication, which this process's device cannot do: {what} "
            f"(torch._scaled_mm: {reason}). Use mixed_precision='bf16' here; to test the fp8 path without fp8 "
            "hardware, pass AORecipeKwargs(config=torchao.float8.Float8LinearConfig(emulate=True))."
        ) from None


class Float8Training:
    """torchao float8 training of a model's linear layers, as one ``AORecipeKwargs`` says.

    Args:
        recipe: the ``AORecipeKwargs`` in force.
        device: the process's device; checked for float8 matmuls unless the recipe's config emulates them.
    """

    def __init__(self, recipe: AORecipeKwargs, device: torch.device):
        self.config = recipe.config
        self.module_filter = recipe.module_filter_func
        if not getattr(self.config, "emulate", False):
            check_fp8_device(device)

    def convert(self, model: torch.nn.Module, sharded: bool = False) -> None:
        """Swap ``model``'s eligible linear layers for torchao's ``Float8Linear`` in place (once per model).

        ``sharded``: FSDP will shard the model over several processes, so the recipe's float8 all-gather applies;
        otherwise it is left off: it only changes how FSDP gathers weights, its weight wrapper would replace
        parameters that an optimizer built before ``prepare`` holds, and on a one-process mesh nothing gathers the
        wrapped weights back into plain tensors for state dicts.
        """
        from torchao.float8 import convert_to_float8_training
        from torchao.float8.float8_linear import Float8Linear

        if any(isinstance(module, Float8Linear) for module in model.modules()):
            return
        config = self.config
        if not sharded and config.enable_fsdp_float8_all_gather:
            config = dataclasses.replace(config, enable_fsdp_float8_all_gather=False)
        module_filter = self.module_filter or default_module_filter(model)
        convert_to_float8_training(model, module_filter_fn=module_filter, config=config)

    def attach_optimizer(self, optimizer: torch.optim.Optimizer, models: list) -> None:
        """After each step of ``optimizer``, precompute the float8 scales of the sharded weights of ``models`` that
        FSDP all-gathers in float8: one all-reduce for all of them instead of one per weight per forward."""
        from torch.distributed.tensor import DTensor
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
        from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

        def gathers_in_float8(model: torch.nn.Module) -> bool:
            return any(
                isinstance(p, DTensor) and isinstance(p._local_tensor, WeightWithDynamicFloat8CastTensor)
                for p in model.parameters()
            )

        own = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for model in models:
            if gathers_in_float8(model) and any(id(p) in own for p in model.parameters()):
                optimizer.register_step_post_hook(
                    lambda *args, model=model: precompute_float8_dynamic_scale_for_fsdp(model)
                )


def float8_training(mixed_precision: str, recipe, device: torch.device) -> Float8Training | None:
    """The fp8 policy for ``mixed_precision`` (None unless it is ``"fp8"``).

    ``recipe`` is the ``AORecipeKwargs`` or ``FP8RecipeKwargs`` passed to the Accelerator (None: the launch's
    ``fp8_config.backend`` decides, torchao by default). Errors are raised here, before any model is prepared:
    a recipe without fp8, a backend hasten does not support, torchao missing, a device without float8 matmuls.
    """
    if mixed_precision != "fp8":
        if recipe is not None:
            raise ConfigError(
                f"{type(recipe).__name__} was passed in kwargs_handlers but mixed_precision is {mixed_precision!r}: an "
                "fp8 recipe needs mixed_precision='fp8' (Accelerator(mixed_precision='fp8') or --mixed_precision fp8)."
            )
        return None
    if recipe is None:
        row = FP8.by_field("backend")
        backend = str(environment.read_setting(row) or "AO").upper()
        if backend != "AO":
            raise unsupported_backend(backend, f"{row.variable} ({FP8.path(row)}, --{row.flag_name})")
    if not isinstance(
        recipe, AORecipeKwargs
    ):  # None, or an FP8RecipeKwargs (which checked its backend): torchao's defaults
        require_torchao("mixed_precision='fp8' (torchao float8 training)")
        recipe = AORecipeKwargs()
    return Float8Training(recipe, device)
