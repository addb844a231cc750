"""fp8 (torchao float8; emulated on the CPU, real on a GPU with fp8 units) under FSDP2, started by
``hasten launch --use_fsdp --mixed_precision fp8 --fp8_backend ao --fp8_enable_fsdp_float8_all_gather true
--fp8_pad_inner_dim true`` (and, with
``--dynamo_backend``, compiled after sharding) on 2 CPU processes in the tests, on 1 GPU in bench/device_check.sh.
Checks, exiting non-zero on the first failure:

- the launch's fp8 settings reach ``AORecipeKwargs()`` in every process; FSDP's policy gathers bf16 weights;
- the middle linear layers are float8 ones, the first and the last are not, and on several processes FSDP
  all-gathers their weights in float8 (a ``WeightWithDynamicFloat8CastTensor`` inside each sharded weight);
- the optimizer built before ``prepare`` holds the sharded weights, and (several processes) their float8 scales are
  precomputed after each step;
- ten steps train (the loss falls) with the same loss on every rank, and the full state dict gathers plain fp32
  tensors under the model's own names.
"""

import dataclasses
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fp8_model import TinyLM, batch, lm_loss  # noqa: E402

from hasten import Accelerator, PartialState  # noqa: E402
from hasten.utils import AORecipeKwargs  # noqa: E402


def main() -> None:
    from_launch = AORecipeKwargs()
    assert from_launch.config.enable_fsdp_float8_all_gather and from_launch.config.pad_inner_dim, from_launch.config
    device = PartialState().device
    real_fp8 = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
    recipe = AORecipeKwargs(config=dataclasses.replace(from_launch.config, emulate=not real_fp8))
    accelerator = Accelerator(kwargs_handlers=[recipe])
    assert accelerator.mixed_precision == "fp8" and accelerator.distributed_type == "FSDP", (
        accelerator.mixed_precision,
        accelerator.distributed_type,
    )
    policy = accelerator.state.fsdp_plugin.mixed_precision_policy  # the other layers gather bf16 weights, as under bf16
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32), policy
    torch.manual_seed(0)
    model = TinyLM(layers=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    assert (type(model).__name__ == "OptimizedModule") == accelerator.state.dynamo_plugin.enabled, type(model)
    inner = accelerator.unwrap_model(model, keep_torch_compile=False)
    from torch.distributed.tensor import DTensor
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    converted = sorted(name for name, module in inner.named_modules() if isinstance(module, Float8Linear))
    linears = sorted(name for name, module in inner.named_modules() if isinstance(module, torch.nn.Linear))
    assert set(linears) - set(converted) == {"blocks.0.qkv", "head"}, (converted, linears)
    weight = inner.get_submodule("blocks.1.fc").weight
    gathers = accelerator.num_processes > 1  # one process has nothing to gather: the plain weights stay
    assert isinstance(weight, DTensor), type(weight)
    assert isinstance(weight._local_tensor, WeightWithDynamicFloat8CastTensor) == gathers, type(weight._local_tensor)
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert held == {id(p) for p in inner.parameters()}, "the optimizer does not hold the sharded parameters"
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(10):
        inputs, targets = (t.to(device) for t in batch(8, generator))
        loss = lm_loss(model(inputs), targets)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    if gathers:
        assert weight._local_tensor._precomputed_scale is not None, (
            "the float8 scales were not precomputed after a step"
        )
    every = [torch.zeros(len(losses), device=device) for _ in range(accelerator.num_processes)]
    dist.all_gather(every, torch.stack(losses).float())
    assert all(torch.equal(every[0], other) for other in every), every
    assert losses[-1] < 0.8 * losses[0], losses
    state = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        assert "blocks.1.fc.weight" in state and type(state["blocks.1.fc.weight"]) is torch.Tensor, list(state)[:5]
        assert state["blocks.1.fc.weight"].dtype == torch.float32
    kind = "real fp8" if real_fp8 else "emulated fp8"
    accelerator.print(
        f"fp8 fsdp ok ({kind}, {accelerator.num_processes} process(es)): losses {[round(float(x), 4) for x in losses]}"
    )


if __name__ == "__main__":
    main()
