"""Random number generators: seeding, synchronisation across processes, and state capture.

RNG states are captured as JSON-compatible dicts plus tensors (no pickle), so checkpoints can store
them in safetensors/JSON.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from ..enums import RNGType
from ..errors import ConfigError


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed ``random``, ``numpy``, ``torch`` and every accelerator's generator.

    Args:
        seed: the seed.
        device_specific: add the process index, so each process draws different numbers.
        deterministic: also ask torch for deterministic algorithms (slower; some ops then raise).
    """
    if not isinstance(seed, int):
        raise ConfigError(f"set_seed(seed={seed!r}): the seed must be an int.")
    if device_specific:
        from ..state import PartialState

        seed += PartialState().process_index
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds CUDA/XPU/MPS generators of all devices
    if deterministic:
        torch.use_deterministic_algorithms(True)


def _device_module(rng_type: str):
    return {"cuda": getattr(torch, "cuda", None), "xpu": getattr(torch, "xpu", None)}.get(rng_type)


def synchronize_rng_state(rng_type: str | RNGType | None = None, generator: torch.Generator | None = None) -> None:
    """Copy process 0's state of one generator to every process.

    Args:
        rng_type: ``"torch"`` (global CPU generator), ``"cuda"``, ``"xpu"`` or ``"generator"``.
        generator: the generator to synchronise when ``rng_type`` is ``"generator"``.
    """
    from ..state import PROCESS_STATE

    broadcast_rng_state(PROCESS_STATE, rng_type, generator)


def synchronize_rng_states(rng_types: list[str | RNGType], generator: torch.Generator | None = None) -> None:
    """:func:`synchronize_rng_state` for each type in ``rng_types``."""
    from ..state import PROCESS_STATE

    broadcast_rng_states(PROCESS_STATE, rng_types, generator)


def broadcast_rng_state(
    process, rng_type: str | RNGType | None = None, generator: torch.Generator | None = None
) -> None:
    """:func:`synchronize_rng_state` for the process whose state is ``process`` (a ``PartialState`` or
    ``AcceleratorState``: under NCCL the generator's state travels through its ``device``)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    from .operations import broadcast

    rng_type = RNGType(rng_type or "torch")
    if rng_type == RNGType.TORCH:
        state = torch.get_rng_state()
    elif rng_type == RNGType.GENERATOR:
        if generator is None:
            return
        state = generator.get_state()
    else:
        module = _device_module(rng_type.value)
        if module is None or not module.is_available():
            return
        state = module.get_rng_state()
    device = process.device if dist.get_backend() == "nccl" else torch.device("cpu")
    synced = broadcast(state.to(device)).cpu()
    if rng_type == RNGType.TORCH:
        torch.set_rng_state(synced)
    elif rng_type == RNGType.GENERATOR:
        generator.set_state(synced)
    else:
        _device_module(rng_type.value).set_rng_state(synced)


def broadcast_rng_states(process, rng_types: list[str | RNGType], generator: torch.Generator | None = None) -> None:
    """:func:`broadcast_rng_state` for each type in ``rng_types``."""
    for rng_type in rng_types:
        broadcast_rng_state(process, rng_type, generator=generator)


def capture_rng_states() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """This process's generator states as (JSON-compatible metadata, tensors)."""
    version, keys, pos, has_gauss, cached = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    meta = {
        "python": {"version": py_version, "state": list(py_state), "gauss": py_gauss},
        "numpy": {"kind": version, "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
    }
    tensors = {
        "torch": torch.get_rng_state(),
        "numpy_keys": torch.from_numpy(np.asarray(keys, dtype=np.uint32).astype(np.int64)),
    }
    for name in ("cuda", "xpu"):
        module = _device_module(name)
        if module is not None and module.is_available() and module.is_initialized():
            for i, state in enumerate(module.get_rng_state_all()):
                tensors[f"{name}_{i}"] = state
    return meta, tensors


def restore_rng_states(meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """Restore the states captured by :func:`capture_rng_states`."""
    py = meta["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    npm = meta["numpy"]
    keys = tensors["numpy_keys"].numpy().astype(np.uint32)
    np.random.set_state((npm["kind"], keys, npm["pos"], npm["has_gauss"], npm["cached_gaussian"]))
    torch.set_rng_state(tensors["torch"])
    for name in ("cuda", "xpu"):
        keys = sorted(
            (k for k in tensors if k.startswith(name + "_") and k[len(name) + 1 :].isdigit()),
            key=lambda k: int(k[len(name) + 1 :]),
        )
        states = [tensors[k] for k in keys]
        module = _device_module(name)
        if states and module is not None and module.is_available():
            module.set_rng_state_all(states[: module.device_count()])
