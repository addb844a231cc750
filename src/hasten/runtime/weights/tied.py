"""Tied weights: parameters that several names of a model refer to.

A model that reuses a parameter (a language model's output layer sharing the embedding's weight) lists it under
each name in ``named_parameters(remove_duplicate=False)``. Saving writes such a tensor once
(:func:`~.safetensors_io.dedupe_tensors`) and loading must tie the names again; this module finds the groups.
"""

from __future__ import annotations

from torch import nn


def find_tied_parameters(model: nn.Module) -> list[list[str]]:
    """Groups of parameter names that refer to the same parameter object (tied weights).

    Works on the meta device, since ties are found by identity. Each group is sorted. The groups come in
    Accelerate's order, which follows Python's string hashing (set by ``PYTHONHASHSEED``), so that a planner fed
    with them decides as Accelerate's does in the same process.

    Example:
        >>> find_tied_parameters(model)   # a language model whose output layer reuses the embedding
        [['lm_head.weight', 'transformer.wte.weight']]
    """
    every = dict(model.named_parameters(remove_duplicate=False))
    unique = dict(model.named_parameters())
    first_names = {id(param): name for name, param in reversed(unique.items())}
    groups: dict[str, list[str]] = {}
    # The set is built from key views, as Accelerate builds it: a set built from a dict is sized differently and
    # would iterate in another order.
    for name in set(every.keys()) - set(unique.keys()):
        groups.setdefault(first_names[id(every[name])], []).append(name)
    return [sorted([first, *set(others)]) for first, others in groups.items()]
