"""The training steps behind tests/fixtures/accelerate_checkpoints/, shared by the fixture generator
(run with the real Accelerate) and by tests/checkpointing/test_accelerate_checkpoints.py (run with hasten), so both
take exactly the same steps."""

from __future__ import annotations

import random

import numpy as np
import torch
import torch.nn.functional as F


class Counter:
    """A custom object registered for checkpointing: plain values and a tensor in its state."""

    def __init__(self):
        self.value = 0
        self.history = [1.5, (2, "x")]
        self.weights = torch.zeros(3)

    def state_dict(self):
        return {"value": self.value, "history": self.history, "weights": self.weights + self.value}

    def load_state_dict(self, state):
        self.value, self.history, self.weights = state["value"], state["history"], state["weights"] - state["value"]


def build_two_models():
    """Two models with dropout, AdamW + SGD with momentum, and a LinearLR scheduler (not yet prepared)."""
    torch.manual_seed(0)
    model_a = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.25), torch.nn.Linear(8, 1))
    model_b = torch.nn.Linear(3, 2)
    opt_a = torch.optim.AdamW(model_a.parameters(), lr=1e-2, weight_decay=0.1)
    opt_b = torch.optim.SGD(model_b.parameters(), lr=5e-2, momentum=0.9)
    sched = torch.optim.lr_scheduler.LinearLR(opt_a, start_factor=0.5, total_iters=10)
    return model_a, model_b, opt_a, opt_b, sched


def _weights(model) -> dict:
    return {k: v.detach().reshape(-1).tolist() for k, v in model.state_dict().items()}


def _draws() -> dict:
    return {"python": random.random(), "numpy": float(np.random.rand()), "torch": torch.rand(3).tolist()}


def continue_two_models(objects, backward) -> dict:
    """One training step of the two-model fixture on data drawn from the global generators."""
    model_a, model_b, opt_a, opt_b, sched = objects
    x, y, xb = torch.randn(8, 4), torch.randn(8, 1), torch.randn(5, 3)
    loss = F.mse_loss(model_a(x), y) + model_b(xb).pow(2).mean()
    backward(loss)
    opt_a.step()
    opt_b.step()
    sched.step()
    opt_a.zero_grad()
    opt_b.zero_grad()
    return {
        "loss": loss.item(),
        "model_a": _weights(model_a),
        "model_b": _weights(model_b),
        "lr": sched.get_last_lr(),
        "draws": _draws(),
    }


def build_bin():
    """One model, Adam and OneCycleLR (not yet prepared)."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=20)
    return model, opt, sched


def continue_bin(objects, backward) -> dict:
    """One training step of the single-model fixture."""
    model, opt, sched = objects
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    loss = F.mse_loss(model(x).float(), y)
    backward(loss)
    opt.step()
    sched.step()
    opt.zero_grad()
    return {"loss": loss.item(), "model": _weights(model), "lr": sched.get_last_lr(), "draws": _draws()}
