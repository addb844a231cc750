"""Differential scenarios for empty initialisation and the forward hooks, and ``scenario_any`` (the fast group's
dispatcher: the case names the scenario to run).

init_empty_weights / init_on_device: what a model built inside the context holds (devices, dtypes, classes, values
of the tensors left real), and what ``nn.Module.register_parameter``/``register_buffer`` and torch's constructors are
inside and after the context, including when the body raises or replaces them itself.

Hooks: a small chain model that really runs forward, put through a sequence of operations (add_hook_to_module with
a custom hook or an AlignDevicesHook, with or without offload, weights_map and execution device; append;
remove_hook_from_module; remove_hook_from_submodules; attach_align_device_hook; attach_align_device_hook_on_blocks;
cpu_offload; align_module_device), each followed by a forward and a record of every tensor and hook.
"""

from __future__ import annotations

import importlib
import os
import random

import torch
from big_modeling.differential_models import random_knobs, random_tree
from torch import nn


def scenario_any(case: dict):
    """Run the scenario named by ``case["scenario"]`` ("module:function") on the rest of the case."""
    module_name, function_name = case["scenario"].split(":")
    function = getattr(importlib.import_module(module_name), function_name)
    return function({key: value for key, value in case.items() if key != "scenario"})


def _tensor_record(model: nn.Module) -> list:
    out = []
    for name, tensor in list(model.named_parameters(remove_duplicate=False)) + list(
        model.named_buffers(remove_duplicate=False)
    ):
        out.append([name, type(tensor).__name__, tensor.requires_grad, tensor.detach()])
    return out


def _shared(model: nn.Module) -> list:
    """Groups of names that hold one tensor object (tied weights)."""
    groups: dict = {}
    for name, tensor in list(model.named_parameters(remove_duplicate=False)) + list(
        model.named_buffers(remove_duplicate=False)
    ):
        groups.setdefault(id(tensor), []).append(name)
    return sorted(sorted(names) for names in groups.values() if len(names) > 1)


def _patched_state(originals: dict) -> dict:
    return {name: getattr(owner, attr) is original for name, (owner, attr, original) in originals.items()}


def _originals() -> dict:
    entries = {
        "register_parameter": (nn.Module, "register_parameter"),
        "register_buffer": (nn.Module, "register_buffer"),
    }
    entries.update({name: (torch, name) for name in ("empty", "zeros", "ones", "full")})
    return {name: (owner, attr, getattr(owner, attr)) for name, (owner, attr) in entries.items()}


def _context(case: dict):
    import accelerate

    include = case["include_buffers"]
    if case["context"] == "init_empty_weights":
        return (
            accelerate.init_empty_weights(include_buffers=include)
            if include is not None
            else accelerate.init_empty_weights()
        )
    device = torch.device(case["context"].removeprefix("init_on_device_"))
    return (
        accelerate.init_on_device(device, include_buffers=include)
        if include is not None
        else accelerate.init_on_device(device)
    )


def _build_inside(case: dict) -> tuple[nn.Module, dict]:
    torch.manual_seed(case["seed"])
    originals = _originals()
    inside: dict = {}
    with _context(case):
        inside["patched"] = _patched_state(originals)
        model = random_tree(case["tree"], case["knobs"], device=None)
        extra = nn.Linear(3, 2)
        extra.weight._is_hf_initialized = True
        extra.register_parameter("nothing", None)
        extra.register_buffer("steps", torch.arange(3), persistent=False)
        model.add_module("extra", extra)
        if case["replace_inside"]:
            nn.Module.register_buffer = _replacement(originals["register_buffer"][2])
            nn.Module.register_parameter = _replacement(originals["register_parameter"][2])
        if case["nested"]:
            with _context({**case, "context": "init_on_device_cpu", "include_buffers": False}):
                model.add_module("nested", nn.Linear(2, 2))
    inside["hf_mark"] = getattr(model.extra.weight, "_is_hf_initialized", None)
    return model, inside


def _replacement(original):
    def register(module, *args, **kwargs):
        return original(module, *args, **kwargs)

    register.replaced_by_scenario = True
    return register


def scenario_init_empty_weights(case: dict):
    """A model built in the context: its tensors, what was patched inside, what is restored after."""
    originals = _originals()
    if case["env"] is not None:
        os.environ["ACCELERATE_INIT_INCLUDE_BUFFERS"] = case["env"]
    try:
        if case["raise_inside"]:
            try:
                with _context(case):
                    raise KeyError("raised inside the context")
            except KeyError:
                pass
            return {"after": _patched_state(originals)}
        model, inside = _build_inside(case)
        after = _patched_state(originals)
        replaced = {
            name: getattr(getattr(nn.Module, name), "replaced_by_scenario", False)
            for name in ("register_parameter", "register_buffer")
        }
        return {
            "tensors": _tensor_record(model),
            "inside": inside,
            "after": after,
            "replaced_after": replaced,
            "shared": _shared(model),
        }
    finally:
        for owner, attr, original in originals.values():
            setattr(owner, attr, original)
        os.environ.pop("ACCELERATE_INIT_INCLUDE_BUFFERS", None)


def init_cases(seed: int, count: int) -> list[dict]:
    """Cases for init_empty_weights / init_on_device: include_buffers, the environment flag, nesting, raising and
    replacing the patched methods."""
    rng = random.Random(seed)
    return [
        {
            "seed": seed * 100_000 + index,
            "tree": rng.randrange(10**6),
            "knobs": random_knobs(rng),
            "context": rng.choice(
                ("init_empty_weights", "init_empty_weights", "init_on_device_meta", "init_on_device_cpu")
            ),
            "include_buffers": rng.choice((None, True, False)),
            "env": rng.choice((None, None, "1", "0", "true")),
            "nested": rng.random() < 0.3,
            "raise_inside": rng.random() < 0.15,
            "replace_inside": rng.random() < 0.25,
        }
        for index in range(count)
    ]


class Chain(nn.Module):
    """A block that runs its children in turn and adds its buffer ``shift``: forward works on a (batch, width) input."""

    def forward(self, x):
        for child in self.children():
            x = child(x)
        shift = self._buffers.get("shift")
        return x if shift is None else x + shift


def chain_model(seed: int) -> nn.Module:
    """A root Chain of Linear layers and Chain blocks with buffers (persistent or not) and an own parameter."""
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    root, width = Chain(), rng.choice((2, 3, 4))
    for index in range(rng.randint(2, 4)):
        out = rng.choice((2, 3, 4))
        if rng.random() < 0.5:
            block, middle = Chain(), rng.choice((2, 3))
            block.add_module("fc0", nn.Linear(width, middle))
            block.add_module("fc1", nn.Linear(middle, out))
            if rng.random() < 0.7:
                block.register_buffer("shift", torch.randn(out, generator=generator), persistent=rng.random() < 0.6)
            root.add_module(f"block{index}", block)
        else:
            root.add_module(f"layer{index}", nn.Linear(width, out))
        width = out
    with torch.no_grad():
        for param in root.parameters():
            param.copy_(torch.randn(param.shape, generator=generator))
    return root


def _custom_hook(accelerate_hooks):
    class Doubling(accelerate_hooks.ModelHook):
        """Doubles the first input and the output; counts its calls."""

        def __init__(self):
            self.calls = 0

        def pre_forward(self, module, *args, **kwargs):
            self.calls += 1
            return (args[0] * 2, *args[1:]), kwargs

        def post_forward(self, module, output):
            return output * 2

    return Doubling()


def _hook(kind: str, model: nn.Module):
    import accelerate.hooks as hooks

    if kind == "custom":
        return _custom_hook(hooks)
    options = {
        "align_cpu": {"execution_device": "cpu"},
        "align_io": {"execution_device": "cpu", "io_same_device": True},
        "offload_no_device": {"offload": True},
        "offload_cpu": {"execution_device": "cpu", "offload": True},
        "offload_buffers": {"execution_device": "cpu", "offload": True, "offload_buffers": True},
        "offload_map": {
            "execution_device": "cpu",
            "offload": True,
            "weights_map": {n: t.clone() for n, t in model.state_dict().items()},
        },
        "place_submodules": {"execution_device": "cpu", "place_submodules": True},
    }[kind]
    return hooks.AlignDevicesHook(**options)


def _modules(model: nn.Module) -> dict:
    return dict(model.named_modules())


def _apply(op: list, model: nn.Module, record: list) -> None:
    import accelerate
    import accelerate.hooks as hooks
    from accelerate.utils import has_offloaded_params

    kind, target = op[0], _modules(model).get(op[1] if len(op) > 1 else "", model)
    if kind == "add":
        hooks.add_hook_to_module(target, _hook(op[2], target), append=op[3])
    elif kind == "remove":
        hooks.remove_hook_from_module(target, recurse=op[2])
    elif kind == "remove_submodules":
        hooks.remove_hook_from_submodules(target)
    elif kind == "attach":
        weights = {n: t.clone() for n, t in target.state_dict().items()} if op[3] else None
        hooks.attach_align_device_hook(
            target,
            "cpu",
            offload=op[2],
            weights_map=weights,
            offload_buffers=op[4],
            preload_module_classes=["Chain"] if op[5] else None,
        )
    elif kind == "blocks":
        names = [name for name, _ in model.named_children()]
        devices = {name: "cpu" for name in ["", *names]} if op[2] else "cpu"
        offload = {name: index % 2 == 0 for index, name in enumerate(["", *names])} if op[3] else bool(op[4])
        weights = {n: t.clone() for n, t in model.state_dict().items()}
        hooks.attach_align_device_hook_on_blocks(model, devices, offload, weights, offload_buffers=op[4])
    elif kind == "cpu_offload":
        accelerate.cpu_offload(model, execution_device="cpu", offload_buffers=op[2])
    elif kind == "align":
        from accelerate.utils import align_module_device

        with align_module_device(target, op[2]):
            record.append(["inside align", _tensor_record(model)])
    record.append(
        [
            op,
            [
                [
                    name,
                    has_offloaded_params(m),
                    type(getattr(m, "_hf_hook", None)).__name__,
                    "forward" in m.__dict__,
                    "_old_forward" in m.__dict__,
                ]
                for name, m in model.named_modules()
            ],
        ]
    )


def scenario_hooks(case: dict):
    """A sequence of hook operations on a chain model; after each, a forward and the record of tensors and hooks.

    The first exception (from an operation or a forward) ends the case and is the result, so that its type is
    compared as the harness compares exceptions (hasten's may be a subclass of Accelerate's).
    """
    model = chain_model(case["tree"])
    first = next(model.parameters())
    inputs = torch.randn(2, first.shape[1], generator=torch.Generator().manual_seed(case["seed"]))
    record: list = []
    for op in case["ops"]:
        _apply(op, model, record)
        record.append(["output", model(inputs)])
        record.append(["tensors", _tensor_record(model)])
    return record


HOOK_KINDS = (
    "custom",
    "align_cpu",
    "align_io",
    "offload_no_device",
    "offload_cpu",
    "offload_buffers",
    "offload_map",
    "place_submodules",
)


def _random_op(rng: random.Random, targets: list[str]) -> list:
    kind = rng.choice(("add", "add", "add", "remove", "remove_submodules", "attach", "blocks", "cpu_offload", "align"))
    target = rng.choice(targets)
    if kind == "add":
        return [kind, target, rng.choice(HOOK_KINDS), rng.random() < 0.4]
    if kind == "remove":
        return [kind, target, rng.random() < 0.5]
    if kind == "remove_submodules":
        return [kind, target]
    if kind == "attach":
        return [kind, target, rng.random() < 0.6, rng.random() < 0.5, rng.random() < 0.3, rng.random() < 0.3]
    if kind == "blocks":
        return [kind, "", rng.random() < 0.6, rng.random() < 0.5, rng.random() < 0.4]
    if kind == "cpu_offload":
        return [kind, "", rng.random() < 0.3]
    return [kind, target, rng.choice(("cpu", "meta", None))]


def hook_cases(seed: int, count: int) -> list[dict]:
    """Cases for the hooks: a chain model and 1 to 4 operations."""
    rng = random.Random(seed)
    cases = []
    for index in range(count):
        tree = rng.randrange(10**6)
        targets = [name for name, _ in chain_model(tree).named_modules()]
        ops = [_random_op(rng, targets) for _ in range(rng.randint(1, 4))]
        cases.append({"seed": seed * 100_000 + index, "tree": tree, "ops": ops})
    return cases
