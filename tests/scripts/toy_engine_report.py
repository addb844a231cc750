"""Builds an Accelerator (``sys.argv[1]``: "launch" for the launch's choice, "name" for strategy="toy", "plugin" for
strategy=ToyPlugin(scale=3)), prepares a model, and prints what it trains with as JSON."""

import json
import sys

import torch

from hasten import Accelerator

how = sys.argv[1]
if how == "name":
    accelerator = Accelerator(strategy="toy")
elif how == "plugin":
    from toy_engine.plugin import ToyPlugin

    accelerator = Accelerator(strategy=ToyPlugin(scale=3))
else:
    accelerator = Accelerator()
model = accelerator.prepare(torch.nn.Linear(2, 2))
report = {
    "strategy": type(accelerator._strategy).__name__,
    "distributed_type": accelerator.distributed_type,  # a str enum: JSON writes its value
    "plugin_scale": accelerator.state.toy_plugin.scale if accelerator.state.toy_plugin is not None else None,
    "model_scale": getattr(model, "toy_scale", None),
}
print("REPORT " + json.dumps(report))
