"""A tiny regression problem for tests (Accelerate's ``accelerate.test_utils.training``): ``y = a * x + b`` plus noise,
and the two-parameter model that learns it. Deterministic for a given seed, so runs can be compared exactly.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import NotSupportedError


class RegressionDataset:
    """``length`` samples ``{"x": x, "y": a * x + b + noise}`` (float32; x standard normal, noise of scale 0.1), drawn
    from ``numpy.random.default_rng(seed)``."""

    def __init__(self, a=2, b=3, length=64, seed=None):
        rng = np.random.default_rng(seed)
        self.length = length
        self.x = rng.normal(size=(length,)).astype(np.float32)
        self.y = a * self.x + b + rng.normal(scale=0.1, size=(length,)).astype(np.float32)

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}


class RegressionModel(torch.nn.Module):
    """``x * a + b`` with the scalar parameters ``a`` and ``b``. On its first batch it prints the dtypes of its
    parameters and input (mixed-precision tests read them). ``double_output`` is kept as an attribute only: as in
    Accelerate, the model returns one tensor."""

    def __init__(self, a=0, b=0, double_output=False):
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor(a).float())
        self.b = torch.nn.Parameter(torch.tensor(b).float())
        self.double_output = double_output
        self.first_batch = True

    def forward(self, x=None):
        if self.first_batch:
            print(f"Model dtype: {self.a.dtype}, {self.b.dtype}. Input dtype: {x.dtype}")
            self.first_batch = False
        return x * self.a + self.b


def _needs_the_hub(name: str) -> NotSupportedError:
    return NotSupportedError(
        f"{name} builds GLUE/MRPC loaders with a tokenizer downloaded from the Hugging Face Hub and Accelerate's "
        "sample files; hasten's test helpers work offline. Use RegressionDataset/RegressionModel, or build the loaders "
        "yourself."
    )


def mocked_dataloaders(accelerator, batch_size: int = 16):
    """Not available in hasten (needs the Hub); raises NotSupportedError."""
    raise _needs_the_hub("mocked_dataloaders")


def mocked_dataloaders_for_autoregressive_models(accelerator, batch_size: int = 16):
    """Not available in hasten (needs the Hub); raises NotSupportedError."""
    raise _needs_the_hub("mocked_dataloaders_for_autoregressive_models")
