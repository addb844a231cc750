"""Reading DeepSpeed ZeRO checkpoints safely, and merging their shards into one fp32 model.

DeepSpeed writes its checkpoints with ``torch.save`` (pickles). hasten reads them with
``torch.load(weights_only=True)``, allowing only the few DeepSpeed classes those files hold, so a
tampered file cannot run code. Merging (the job of DeepSpeed's ``zero_to_fp32.py``) rebuilds each
parameter from the fp32 master copies partitioned over the ranks' optimizer files; it needs neither
DeepSpeed nor a process group.
"""

from __future__ import annotations

import enum
import math
import mmap
import os
import pickle
import re
from pathlib import Path

import torch

from ...errors import CheckpointError

_SAFE_CLASSES = {
    "deepspeed.runtime.zero.config.ZeroStageEnum": "ZeroStageEnum",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": "LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": "DynamicLossScaler",
    "deepspeed.utils.tensor_fragment.fragment_address": "fragment_address",
}


class _ZeroStage(enum.IntEnum):
    """Stands for DeepSpeed's ``ZeroStageEnum`` when reading a checkpoint without DeepSpeed."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


class _Record:
    """Stands for a DeepSpeed object (loss scaler, fragment address) when reading without DeepSpeed."""


def _stand_ins() -> list:
    return [
        (_ZeroStage if short == "ZeroStageEnum" else type(short, (_Record,), {}), name)
        for name, short in _SAFE_CLASSES.items()
    ]


def deepspeed_classes() -> list:
    """DeepSpeed's own checkpoint classes, to allow when DeepSpeed itself restores the state."""
    import importlib

    classes = []
    for name in _SAFE_CLASSES:
        module, _, attr = name.rpartition(".")
        classes.append(getattr(importlib.import_module(module), attr))
    return classes


def safe_torch_load(source, name, map_location=None, classes=None, mapped: bool = False):
    """``torch.load(weights_only=True)`` that allows DeepSpeed's checkpoint classes and nothing else.

    Args:
        source: a path or a binary file object.
        name: the file's name, for messages.
        map_location: as for ``torch.load``.
        classes: the classes to allow (default: stand-ins that need no DeepSpeed).
        mapped: map the file's tensors from the page cache (``source`` a path) instead of copying them into memory:
            for a reader that copies them elsewhere at once.
    """
    allowed = _stand_ins() if classes is None else list(classes)
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(source, map_location=map_location, weights_only=True, mmap=mapped)
    except pickle.UnpicklingError as error:
        raise CheckpointError(
            f"{name} holds a Python object hasten does not load, because loading it could run code from the file:\n"
            f"{error}\n"
            "If you trust the file, allow the class with torch.serialization.add_safe_globals([...]) and load again."
        ) from None


# ------------------------------------------------------------------------------------ finding


def verified_loader(reader, mapped: bool = False):
    """A ``load(path, map_location=None)`` for engine checkpoint files: each file's checksum is checked against the
    manifest of ``reader`` (an open hasten checkpoint; None: Accelerate's, which has none) and no code is executed.
    A file the manifest does not list is refused: the checkpoint was changed after it was saved.

    The check reads the file through a read-only mapping (no copy), then the tensors are read from the file once:
    copied into memory (DeepSpeed's own load keeps what it is given), or with ``mapped`` mapped from the page cache,
    for a reader that copies them elsewhere at once
    (:func:`~hasten.strategies.deepspeed.resharding.read_zero_checkpoint`).
    """

    def load(path, map_location=None):
        if reader is not None:
            _check(reader, path)
        return safe_torch_load(str(path), path, map_location, classes=deepspeed_classes(), mapped=mapped)

    return load


def _check(reader, path) -> None:
    """Check ``path`` against the manifest, reading it through a read-only mapping (an empty file as no bytes)."""
    name = Path(path).resolve().relative_to(reader.directory.resolve()).as_posix()
    if reader.files.get(name) is None:
        raise CheckpointError(
            f"{path} is not listed in the manifest of {reader.directory}: the checkpoint was changed after it was "
            "saved."
        )
    with open(path, "rb") as handle:
        if os.fstat(handle.fileno()).st_size == 0:
            reader.check_bytes(name, b"")
            return
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as view:
            reader.check_bytes(name, view)


def find_deepspeed_checkpoint(path: str | os.PathLike) -> Path | None:
    """The folder holding the ``*_model_states.pt`` files of a DeepSpeed checkpoint, or None.

    ``path`` may be a checkpoint written by ``save_state`` (with a ``deepspeed/`` folder), the folder
    given to ``engine.save_checkpoint`` (with a ``latest`` file naming the tag), or the tag folder.
    """
    folder = Path(path)
    if (folder / "deepspeed").is_dir():
        folder = folder / "deepspeed"
    latest = folder / "latest"
    if latest.is_file():
        folder = folder / latest.read_text().strip()
    return folder if folder.is_dir() and any(folder.glob("*_model_states.pt")) else None


def _natural(path: Path):
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path.name)]


def _files(folder: Path, pattern: str) -> list[Path]:
    files = sorted(folder.glob(pattern), key=_natural)
    if not files:
        raise CheckpointError(
            f"{folder} has no {pattern} files: it is not a DeepSpeed ZeRO checkpoint (or it was saved without ZeRO)."
        )
    return files


# ------------------------------------------------------------------------------------ world size

_OPTIMIZER_SHARD = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt")


def check_world_size(file_names, directory, world_size: int) -> int | None:
    """How many processes partitioned a ZeRO checkpoint, when that is not ``world_size`` (None when it is).

    Such a checkpoint is partitioned again by :mod:`~hasten.strategies.deepspeed.resharding`, which refuses,
    before anything is loaded, what it cannot partition again (ZeRO stage 0's bf16 optimizer, model parallelism).

    Args:
        file_names: the checkpoint's file names (relative paths; those of the engine's ``*_optim_states.pt``
            files, ``bf16_`` prefixed or not, are looked at).
        directory: the checkpoint folder, for messages.
        world_size: the data-parallel processes of this run.
    """
    saved = {int(m.group(1)) for name in file_names if (m := _OPTIMIZER_SHARD.fullmatch(Path(name).name))}
    return len(saved) if saved and len(saved) != world_size else None


def saved_under_zero3(file_names) -> bool:
    """Whether a DeepSpeed checkpoint's files (relative names) were written under ZeRO stage 3, which keeps one model
    file per process (``zero_pp_rank_<r>_mp_rank_<m>_model_states.pt``) where stages 0-2 keep one in all."""
    return any(_ZERO3_MODEL.fullmatch(Path(name).name) for name in file_names)


_ZERO3_MODEL = re.compile(r"zero_pp_rank_\d+_mp_rank_\d+_model_states\.pt")


# ------------------------------------------------------------------------------------ merging


def load_fp32_state_dict(
    checkpoint_dir: str | os.PathLike, exclude_frozen_parameters: bool = False
) -> dict[str, torch.Tensor]:
    """Rebuild the full fp32 state dict of a ZeRO (stage 1, 2 or 3) checkpoint.

    Args:
        checkpoint_dir: anything :func:`find_deepspeed_checkpoint` accepts.
        exclude_frozen_parameters: leave out parameters that were not trained.
    """
    folder = find_deepspeed_checkpoint(checkpoint_dir)
    if folder is None:
        raise CheckpointError(
            f"{checkpoint_dir} holds no DeepSpeed checkpoint: expected a folder with *_model_states.pt files, a folder "
            "with a 'latest' file naming one, or a hasten checkpoint with a deepspeed/ folder."
        )
    models = [safe_torch_load(path, path) for path in _files(folder, "*_model_states.pt")]
    optimizer_files = _files(folder, "*_optim_states.pt")
    optimizers = [safe_torch_load(path, path, map_location="cpu")["optimizer_state_dict"] for path in optimizer_files]
    stage = int(optimizers[0]["zero_stage"])
    world = optimizers[0]["partition_count"]
    world = max(world) if isinstance(world, list) else int(world)
    if world != len(optimizer_files):
        raise CheckpointError(
            f"{folder} should hold {world} *_optim_states.pt files (one per rank) but holds {len(optimizer_files)}: "
            "the checkpoint is incomplete."
        )
    state = {
        name: (t.float() if t.is_floating_point() else t)
        for name, t in models[0]["module"].items()
        if name in models[0]["buffer_names"]
    }
    if stage <= 2:
        if not exclude_frozen_parameters:
            state.update(models[0].get("frozen_param_fragments") or {})
        flats = [o["single_partition_of_fp32_groups"] for o in optimizers]
        state.update(
            _merge_zero12(models[0]["param_shapes"], flats, optimizers[0].get("param_alignment_paddings"), folder)
        )
    else:
        if not exclude_frozen_parameters:
            state.update(_merge_zero3_frozen(models, world))
        flats = [torch.cat([group.reshape(-1) for group in o["fp32_flat_groups"]]) for o in optimizers]
        state.update(_merge_zero3(models[0]["param_shapes"], flats, folder))
    for alias, source in (models[0].get("shared_params") or {}).items():
        if source in state:
            state[alias] = state[source]
    return state


def _merge_zero12(param_shapes: list, flats: list, paddings, folder: Path) -> dict[str, torch.Tensor]:
    """Stages 1 and 2: each group is one flat vector split in consecutive slices over the ranks."""
    state = {}
    for index, shapes in enumerate(param_shapes):
        full = torch.cat([rank_groups[index] for rank_groups in flats])
        offset = 0
        for position, (name, shape) in enumerate(shapes.items()):
            count = math.prod(shape)
            state[name] = full.narrow(0, offset, count).view(shape).clone()
            offset += count + (paddings[index][position] if paddings else 0)
        if offset > full.numel():
            raise CheckpointError(
                f"{folder}: parameter group {index} needs {offset} values but the optimizer files hold {full.numel()}; "
                "the checkpoint is corrupt."
            )
    return state


def _merge_zero3(param_shapes: list, flats: list, folder: Path) -> dict[str, torch.Tensor]:
    """Stage 3: every parameter is split over the ranks, each rank holding ceil(n / ranks) values."""
    world = len(flats)
    state, offset = {}, 0
    for shapes in param_shapes:
        for name, shape in shapes.items():
            count = math.prod(shape)
            part = math.ceil(count / world)
            if offset + part > flats[0].numel():
                raise CheckpointError(
                    f"{folder}: the optimizer files end before parameter {name!r}; the checkpoint is corrupt."
                )
            pieces = [flat.narrow(0, offset, part) for flat in flats]
            state[name] = torch.cat(pieces)[:count].view(shape).clone()
            offset += part
    return state


def _merge_zero3_frozen(models: list, world: int) -> dict[str, torch.Tensor]:
    shapes = models[0].get("frozen_param_shapes") or {}
    state = {}
    for name, shape in shapes.items():
        pieces = [model["frozen_param_fragments"][name] for model in models[:world]]
        state[name] = torch.cat(pieces)[: math.prod(shape)].view(shape).clone()
    return state


def merge_deepspeed_weights(
    checkpoint_dir: str | os.PathLike,
    output_path: str | os.PathLike,
    safe_serialization: bool = True,
    max_shard_size: str | int = "10GB",
) -> list[Path]:
    """Merge a ZeRO checkpoint into one fp32 model in ``output_path`` (``model.safetensors``, sharded with an index when
    large).

    Returns:
        The files written.
    """
    from ...runtime.weights.saving import save_model_weights

    return save_model_weights(
        load_fp32_state_dict(checkpoint_dir),
        output_path,
        max_shard_size=max_shard_size,
        safe_serialization=safe_serialization,
    )


__all__ = [
    "check_world_size",
    "deepspeed_classes",
    "find_deepspeed_checkpoint",
    "load_fp32_state_dict",
    "merge_deepspeed_weights",
    "safe_torch_load",
]
