"""Random module trees for the big-model differential tests, built from a seed with plain torch only.

The same ``(seed, knobs)`` builds the same tree in every process (Python's ``random.Random`` is deterministic), so
the reference copy of Accelerate and hasten see identical models without the tree being written into the case.
Nothing here imports ``accelerate``: the test process uses these functions too, to size the memory budgets.

Knobs (all optional): ``depth`` (levels of containers), ``width`` (most children per container), ``buffers``
(persistent and non-persistent float, integer and bool buffers), ``ties`` (tied weights, across branches and with
an embedding/head pair), ``root_params`` (parameters and buffers directly on the root), ``empty`` (modules without
tensors), ``mixed`` (float16 and bfloat16 leaves among float32 ones).
"""

from __future__ import annotations

import contextlib
import random

import torch
from torch import nn

CLASS_NAMES = ("Block", "Layer", "Mlp", "Attention", "Stack")
WIDTHS = (2, 4, 8, 16, 24, 32, 48, 64, 96)
_CLASSES: dict[str, type] = {}


def _passthrough(self, x):
    return x


def module_class(name: str) -> type:
    """A ``nn.Module`` subclass called ``name`` (one per process), so that no_split_module_classes can name it."""
    if name not in _CLASSES:
        _CLASSES[name] = type(name, (nn.Module,), {"forward": _passthrough})
    return _CLASSES[name]


def _dtype(rng: random.Random, knobs: dict) -> torch.dtype:
    if knobs.get("mixed") and rng.random() < 0.3:
        return rng.choice((torch.float16, torch.bfloat16))
    return torch.float32


def _leaf(rng: random.Random, knobs: dict) -> nn.Module:
    kind = rng.choice(
        ("linear", "linear", "linear", "embedding", "norm", "raw", "empty")
        if knobs.get("empty")
        else ("linear", "linear", "linear", "embedding", "norm", "raw")
    )
    dtype = _dtype(rng, knobs)
    if kind == "linear":
        return nn.Linear(rng.choice(WIDTHS), rng.choice(WIDTHS), bias=rng.random() < 0.7, dtype=dtype)
    if kind == "embedding":
        return nn.Embedding(rng.choice(WIDTHS), rng.choice(WIDTHS), dtype=dtype)
    if kind == "norm":
        return nn.LayerNorm(rng.choice(WIDTHS), dtype=dtype)
    if kind == "raw":
        leaf = module_class("Leaf")()
        leaf.register_parameter("w", nn.Parameter(torch.zeros(rng.choice(WIDTHS), rng.choice(WIDTHS), dtype=dtype)))
        return leaf
    return rng.choice((nn.Identity(), nn.ReLU(), module_class("Empty")()))


def _add_buffers(rng: random.Random, module: nn.Module, knobs: dict, chance: float) -> None:
    if not knobs.get("buffers"):
        return
    for index in range(2):
        if rng.random() >= chance:
            continue
        kind = rng.choice(("float", "long", "bool", "float"))
        shape = (rng.choice(WIDTHS),) if rng.random() < 0.7 else (rng.choice(WIDTHS), rng.choice(WIDTHS))
        tensor = {
            "float": torch.zeros(shape),
            "long": torch.zeros(shape, dtype=torch.long),
            "bool": torch.zeros(shape, dtype=torch.bool),
        }[kind]
        module.register_buffer(f"buf{index}", tensor, persistent=rng.random() < 0.7)


def _node(rng: random.Random, depth: int, knobs: dict) -> nn.Module:
    if depth <= 0 or rng.random() < 0.2:
        leaf = _leaf(rng, knobs)
        _add_buffers(rng, leaf, knobs, 0.15)
        return leaf
    count = rng.randint(1, max(1, knobs.get("width", 3)))
    children = [_node(rng, depth - 1, knobs) for _ in range(count)]
    kind = rng.random()
    if kind < 0.2:
        return nn.ModuleList(children)
    if kind < 0.35:
        return nn.Sequential(*children)
    node = module_class(rng.choice(CLASS_NAMES))()
    if rng.random() < 0.15:
        node.register_parameter("scale", nn.Parameter(torch.zeros(rng.choice(WIDTHS), dtype=_dtype(rng, knobs))))
    names = ("fc", "attn", "mlp", "norm", "proj", "inner", "h", "weight_sub")
    for index, child in enumerate(children):
        node.add_module(f"{rng.choice(names)}{index}" if rng.random() < 0.8 else str(index), child)
    _add_buffers(rng, node, knobs, 0.25)
    return node


def _weights(model: nn.Module) -> dict[tuple, list[tuple[nn.Module, str]]]:
    """Weight-like parameters of the leaves, by (shape, dtype): the candidates for tying."""
    found: dict[tuple, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name in ("weight", "w"):
            param = module._parameters.get(name)
            if param is not None and param.dim() == 2:
                found.setdefault((tuple(param.shape), param.dtype), []).append((module, name))
    return found


def _tie(rng: random.Random, model: nn.Module) -> None:
    groups = [owners for owners in _weights(model).values() if len(owners) > 1]
    rng.shuffle(groups)
    for owners in groups[: rng.randint(1, 3)]:
        chosen = rng.sample(owners, rng.randint(2, min(3, len(owners))))
        source_module, source_name = chosen[0]
        for module, name in chosen[1:]:
            setattr(module, name, getattr(source_module, source_name))


def random_tree(seed: int, knobs: dict | None = None, device: str | None = "meta") -> nn.Module:
    """The model of ``(seed, knobs)`` on ``device`` (``"meta"``: no memory; ``"cpu"``: seeded values; None: wherever
    the constructors put tensors, with their own initialisation)."""
    knobs = dict(knobs or {})
    rng = random.Random(seed)
    with torch.device(device) if device is not None else contextlib.nullcontext():
        root = module_class("Model")()
        if knobs.get("root_params") and rng.random() < 0.7:
            root.register_parameter("scale", nn.Parameter(torch.zeros(rng.choice(WIDTHS))))
        children = max(1, rng.randint(1, knobs.get("width", 3) + 1))
        for index in range(children):
            root.add_module(
                rng.choice(("embed", "encoder", "layers", "decoder", "blocks")) + str(index),
                _node(rng, knobs.get("depth", 2), knobs),
            )
        if knobs.get("root_params"):
            _add_buffers(rng, root, {"buffers": True}, 0.6)
        if knobs.get("ties"):
            vocab, dim = rng.choice(WIDTHS), rng.choice(WIDTHS)
            root.add_module("wte", nn.Embedding(vocab, dim))
            root.add_module("head", nn.Linear(dim, vocab, bias=rng.random() < 0.5))
            if rng.random() < 0.8:
                root.head.weight = root.wte.weight
            _tie(rng, root)
    if device not in ("meta", None):
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for tensor in list(root.parameters()) + list(root.buffers()):
                if tensor.is_floating_point():
                    tensor.copy_(torch.randn(tensor.shape, generator=generator).to(tensor.dtype))
                elif tensor.dtype != torch.bool:
                    tensor.copy_(torch.randint(0, 100, tensor.shape, generator=generator))
    return root


def total_size(model: nn.Module) -> int:
    """Bytes of the distinct tensors of ``model`` (a rough size, used only to scale the generated budgets)."""
    seen, total = set(), 0
    for tensor in list(model.parameters()) + list(model.buffers()):
        if id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
    return total


def random_knobs(rng: random.Random) -> dict:
    """A random choice of knobs (each feature on about half the time)."""
    return {
        "depth": rng.randint(1, 4),
        "width": rng.randint(2, 4),
        "buffers": rng.random() < 0.6,
        "ties": rng.random() < 0.5,
        "root_params": rng.random() < 0.4,
        "empty": rng.random() < 0.4,
        "mixed": rng.random() < 0.3,
    }


def no_split_choice(rng: random.Random, model: nn.Module) -> list[str]:
    """Some class names present in ``model`` (or an absent one) to keep whole."""
    present = sorted(
        {type(m).__name__ for m in model.modules() if type(m).__name__ in CLASS_NAMES or rng.random() < 0.05}
    )
    if not present or rng.random() < 0.3:
        return []
    chosen = rng.sample(present, rng.randint(1, min(2, len(present))))
    if rng.random() < 0.1:
        chosen.append("NotInModel")
    return chosen
