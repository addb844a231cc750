"""Differential scenarios of fp8 training through torchao (tests/runtime/test_fp8.py runs them on Accelerate 1.15
and on hasten, tests/differential.py compares). Each case starts from a fresh state and its own environment."""

import os

import torch
from torch import nn


def _fresh(env: dict) -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    for key in [k for k in os.environ if k.startswith(("ACCELERATE_FP8_", "HASTEN_FP8_"))]:
        del os.environ[key]
    os.environ.update(env)


def conversion_and_steps(case: dict):
    """Which layers of a stack of linear layers (``case["widths"]``) become float8 ones, the output dtype and three
    losses of emulated fp8 training; and the config the default recipe builds from the environment."""
    from torchao.float8 import Float8LinearConfig

    from accelerate import Accelerator
    from accelerate.utils import AORecipeKwargs

    _fresh(case["env"])
    torch.manual_seed(case["seed"])
    widths = case["widths"]
    layers = []
    for inputs, outputs in zip(widths, widths[1:]):
        layers += [nn.Linear(inputs, outputs), nn.ReLU()]
    model = nn.Sequential(*layers[:-1])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    default = AORecipeKwargs().config
    recipe = AORecipeKwargs(config=Float8LinearConfig(emulate=True, enable_fsdp_float8_all_gather=False))
    accelerator = Accelerator(mixed_precision="fp8", cpu=True, kwargs_handlers=[recipe])
    model, optimizer = accelerator.prepare(model, optimizer)
    kinds = [type(module).__name__ for module in model]
    data = torch.randn(8, widths[0], generator=torch.Generator().manual_seed(case["seed"]))
    losses, dtype = [], None
    for _ in range(3):
        output = model(data)
        dtype = output.dtype
        loss = output.pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return {
        "kinds": kinds,
        "dtype": dtype,
        "losses": torch.stack(losses),
        "mixed_precision": accelerator.mixed_precision,
        "default": [default.pad_inner_dim, default.enable_fsdp_float8_all_gather, default.emulate],
    }


def refusals(case: dict):
    """An fp8 recipe without ``mixed_precision="fp8"`` (a ValueError in both)."""
    from accelerate import Accelerator
    from accelerate.utils import AORecipeKwargs

    _fresh({})
    return Accelerator(mixed_precision="bf16", cpu=True, kwargs_handlers=[AORecipeKwargs()])
