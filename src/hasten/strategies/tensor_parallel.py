"""Tensor parallelism: split a model's layers across the ``tp`` ranks of the device mesh, as its plan says.

A plan maps module-name patterns (``*`` stands for a layer number, as in transformers' plans) to a
style name; the model carries it the transformers way: ``model._tp_plan`` (transformers fills it
from ``config.base_model_tp_plan``, prefixed, when a model is built), or ``config.base_model_tp_plan``
itself. The plan is applied with DTensor's ``parallelize_module`` before FSDP shards the parameters
over the data-parallel ranks.
"""

from __future__ import annotations

import re

import torch

from ..errors import ConfigError

# styles that split weights -> (the weight dimension split, the DTensor style's factory)
_SPLIT_DIM = {
    "colwise": 0,
    "colwise_rep": 0,
    "colwise_gather_output": 0,
    "embedding_colwise": 1,
    "rowwise": 1,
    "rowwise_rep": 1,
    "rowwise_split_input": 1,
    "embedding_rowwise": 0,
}
# styles that keep the parameters whole on every tensor-parallel rank
_REPLICATED = ("replicate", "replicated_with_grad_allreduce", "sequence_parallel")


def _style(name: str):
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    styles = {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "embedding_colwise": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
        "sequence_parallel": SequenceParallel,
    }
    return styles[name]()


def tp_plan(model: torch.nn.Module) -> dict[str, str]:
    """The tensor-parallel plan ``model`` carries (``_tp_plan``, else ``config.base_model_tp_plan``); ``{}`` without
    one."""
    plan = getattr(model, "_tp_plan", None)
    if not plan:
        config = getattr(model, "config", None)
        plan = getattr(config, "base_model_tp_plan", None) or {}
        prefix = getattr(model, "base_model_prefix", "")
        base = getattr(model, prefix, None) if prefix else None
        if plan and isinstance(base, torch.nn.Module) and base is not model:
            plan = {f"{prefix}.{key}": style for key, style in plan.items()}
    return dict(plan)


def _pattern(key: str) -> re.Pattern:
    return re.compile("^" + re.escape(key).replace(r"\*", r"[^.]+") + "$")


def _weight_dim(module: torch.nn.Module, dim: int) -> int | None:
    weight = getattr(module, "weight", None)
    return None if weight is None else weight.shape[dim]


def resolve_plan(model: torch.nn.Module, plan: dict[str, str], tp_size: int) -> dict[str, str]:
    """Module name -> style for every module the plan names; a :class:`ConfigError` naming the entry that does not fit.

    Each pattern must name at least one module, each style must be one hasten applies, and the
    split weight dimension must divide by ``tp_size``.
    """
    names = [name for name, _ in model.named_modules() if name]
    resolved: dict[str, str] = {}
    for key, style in plan.items():
        if style not in _SPLIT_DIM and style not in _REPLICATED:
            known = ", ".join(sorted((*_SPLIT_DIM, *_REPLICATED)))
            raise ConfigError(
                f"The tensor-parallel plan gives {key!r} the style {style!r}, which hasten does not apply. Use one of: "
                f"{known}."
            )
        pattern = _pattern(key)
        matched = [name for name in names if pattern.match(name)]
        if not matched:
            raise ConfigError(
                f"The tensor-parallel plan entry {key!r} -> {style!r} names no module of {type(model).__name__}. "
                f"Module names look like {names[:4]}; fix the pattern (``*`` stands for a layer number) or remove the "
                "entry."
            )
        for name in matched:
            dim = _SPLIT_DIM.get(style)
            size = None if dim is None else _weight_dim(model.get_submodule(name), dim)
            if size is not None and size % tp_size:
                raise ConfigError(
                    f"tp_size={tp_size} does not divide dimension {dim} (size {size}) of {name}.weight, which the plan "
                    f"entry {key!r} -> {style!r} splits. Choose a tp_size that divides {size}, or leave {name} out of "
                    "the plan."
                )
            resolved[name] = style
    return resolved


def apply_tensor_parallel(model: torch.nn.Module, tp_mesh) -> int:
    """Split ``model``'s layers over ``tp_mesh`` (1-D) as its plan says; return the number of modules split.

    A model without a plan is a :class:`ConfigError`: with ``tp_size > 1`` every rank would hold and
    compute the whole model while the data is not split between them.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    plan = tp_plan(model)
    if not plan:
        raise ConfigError(
            f"tp_size={tp_mesh.size()} but {type(model).__name__} has no tensor-parallel plan. Give the model a "
            "``_tp_plan`` dict (module-name pattern -> 'colwise' / 'rowwise' / ...), as transformers models have, or "
            "set tp_size=1."
        )
    resolved = resolve_plan(model, plan, tp_mesh.size())
    split = {
        name: _style(style)
        for name, style in resolved.items()
        if style not in _REPLICATED or style == "sequence_parallel"
    }
    parallelize_module(model, tp_mesh, split)
    return len(split)


def gather_for_metrics_over_dp(data, tp_size: int, gradient_state, use_gather_object: bool = False):
    """``gather_for_metrics`` when tensor-parallel peers hold the same samples: one copy from each data-parallel rank.

    Ranks are laid out with ``tp`` innermost, so every ``tp_size``-th rank's data, in rank order, is the
    data-parallel gather; the samples padded into the last round of the loader ``gradient_state`` (the strategy's
    :class:`~hasten.state.GradientState`) says is being iterated are dropped as usual.
    """
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    from ..data_loader.metrics import _is_tensor_structure
    from ..runtime.operations import gather_object
    from ..runtime.tree import concatenate, recursively_apply

    loader = gradient_state.active_dataloader
    final = loader.final_round if loader is not None and loader.end_of_dataloader else None
    if _is_tensor_structure(data):
        # outputs of tensor-parallel layers may still wait on their collective: pickling would read them early
        data = recursively_apply(lambda t: t.wait() if isinstance(t, AsyncCollectiveTensor) else t, data)
    copies = gather_object([data])[::tp_size]
    if use_gather_object or not _is_tensor_structure(data):
        gathered = [item for copy in copies for item in (copy if isinstance(copy, (list, tuple)) else [copy])]
    else:
        gathered = concatenate([recursively_apply(lambda t: t[None] if t.ndim == 0 else t, copy) for copy in copies])
    if final is not None and final.padded:
        real = final.real
        gathered = gathered[:real] if isinstance(gathered, list) else recursively_apply(lambda t: t[:real], gathered)
    return gathered
