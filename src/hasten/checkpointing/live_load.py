"""Loading a checkpoint straight into the live model and optimizer tensors.

Where a saved tensor has the shape and dtype of a contiguous CPU tensor of the model or the optimizer,
its bytes are read from the file (page cache or disk) directly into that tensor's memory: one copy,
no new allocation. Other tensors (on a GPU, another dtype) are read into a new CPU tensor and copied.
Modules with their own ``_load_from_state_dict`` or load hooks go through ``load_state_dict``.

The ``check_*`` functions compare the checkpoint with the live objects without changing anything, so
``load_state`` refuses a checkpoint that does not fit before it touches any live object.
"""

from __future__ import annotations

import torch

from ..errors import CheckpointError


def _plain(module: torch.nn.Module) -> bool:
    """True when loading ``module``'s state dict is one copy per tensor (no hooks, no custom loaders)."""
    default = torch.nn.Module._load_from_state_dict
    return all(
        type(sub)._load_from_state_dict is default
        and not sub._load_state_dict_pre_hooks
        and not sub._load_state_dict_post_hooks
        for sub in module.modules()
    )


def check_model(reader, name: str, module: torch.nn.Module) -> None:
    """Raise :class:`CheckpointError` when file ``name`` does not fit ``module`` (keys, shapes); changes nothing."""
    if not _plain(module):
        return
    shapes = reader.tensor_shapes(name)
    live = {key: tuple(value.shape) for key, value in module.state_dict().items()}
    missing = sorted(set(live) - set(shapes))
    unexpected = sorted(set(shapes) - set(live))
    wrong = sorted(
        f"{key} (saved {list(shapes[key])}, model {list(live[key])})"
        for key in set(live) & set(shapes)
        if shapes[key] != live[key]
    )
    if missing or unexpected or wrong:
        parts = [
            f"{label}: {', '.join(keys[:5])}{' ...' if len(keys) > 5 else ''}"
            for label, keys in (("missing", missing), ("unexpected", unexpected), ("shape differs", wrong))
            if keys
        ]
        raise CheckpointError(
            f"{reader.directory / name} does not fit {type(module).__name__} ({'; '.join(parts)}): prepare the same "
            "model as the run that saved it. Nothing was loaded."
        )


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device == b.device and a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.dtype == b.dtype


def load_model(reader, name: str, module: torch.nn.Module) -> None:
    """Fill ``module``'s parameters and buffers from file ``name``, in place where they match."""
    if not _plain(module):
        module.load_state_dict(reader.load_tensors(name))
        return
    live = module.state_dict()
    loaded = reader.load_tensors(name, into=live)
    with torch.no_grad():
        for key, value in loaded.items():
            if not _same_memory(value, live[key]):
                live[key].copy_(value)


def check_optimizer(reader, name: str, optimizer) -> None:
    """Raise :class:`CheckpointError` when the saved optimizer's parameter groups differ from ``optimizer``'s."""
    saved = reader.param_group_sizes(name)
    live = [len(group["params"]) for group in optimizer.param_groups]
    if saved is not None and saved != live:
        raise CheckpointError(
            f"{reader.directory / name}.json holds an optimizer with parameter groups of {saved} parameters, but this "
            f"run's optimizer has {live}: create the optimizer as the run that saved it did. Nothing was loaded."
        )


def load_optimizer(reader, name: str, optimizer) -> None:
    """Restore ``optimizer`` from ``<name>.*``, reading its state tensors into the live ones where they match.

    ``Optimizer.load_state_dict`` keeps a tensor that already has its parameter's dtype and device, so the
    state tensors filled in place stay the optimizer's own: no second copy.
    """
    optimizer.load_state_dict(reader.load_state(name, into=optimizer.state_dict()))
