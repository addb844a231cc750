"""ZeRO checkpoints resumed on another number of processes: the state read per parameter name, then partitioned again.

DeepSpeed keeps a ZeRO checkpoint as one optimizer file per data-parallel process, each holding that process's slice
of flat vectors (the fp32 master weights and every optimizer moment), and loads it on the same number of processes
only. Here :func:`read_zero_checkpoint` reads the files one at a time into one full tensor per parameter name (weights,
moments, step, the parameter groups' hyperparameters, the buffers and the engine's counters and scheduler):
:class:`StateByName`, which knows nothing of the layout it came from. :func:`apply_zero_full_state` is its
counterpart: it writes such a state into a live DeepSpeed engine on the current processes, each taking its own slice
of every tensor, and sets the module's weights from the fp32 masters. Nothing is gathered between processes: every
process reads the files itself, so the cost is one pass over the saved optimizer state per process.

Layouts (DeepSpeed 0.19): under ZeRO-1/2 every parameter group is one flat vector (parameters in order, each
followed by its alignment padding, the whole padded to a multiple of the processes) cut into equal consecutive
partitions, the last one's padding not saved; under ZeRO-3 every parameter is cut into ``ceil(numel / processes)``
values per process, and a process's flat vector is its slices of the parameters in order.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from ...errors import CheckpointError
from ...logging import get_logger
from ..engine_change import StateByName
from .checkpoint import _files, find_deepspeed_checkpoint, safe_torch_load

_ENGINE_KEYS = ("lr_scheduler", "global_steps", "global_samples", "skipped_steps")
_SCALER_KEYS = ("loss_scaler", "dynamic_loss_scale", "overflow")


class EngineCheckpoint(NamedTuple):
    """Where a checkpoint keeps an engine's state: ``folder / tag`` holds the files named in ``files``."""

    folder: Path
    tag: str
    files: list[str]
    accelerate: bool  # written by Accelerate: no manifest, the scheduler saved outside the engine

    @property
    def path(self) -> Path:
        """The folder of the engine's ``*.pt`` files."""
        return self.folder / self.tag


def engine_checkpoint(reader, index: int, folder: str, tag: str) -> EngineCheckpoint:
    """Where the engine state of prepared model ``index`` lies in a checkpoint.

    hasten writes it to ``<checkpoint>/<folder>/<tag>/``; Accelerate (``reader.manifest["format"] ==
    "accelerate"``) to ``<checkpoint>/pytorch_model[_<index>]/``.

    Raises:
        CheckpointError: the checkpoint holds none (it was not saved under DeepSpeed).
    """
    if reader.manifest.get("format") == "accelerate":
        tag = "pytorch_model" if index == 0 else f"pytorch_model_{index}"
        found = EngineCheckpoint(
            reader.directory, tag, sorted(p.name for p in (reader.directory / tag).glob("*.pt")), True
        )
    else:
        files = [name for name in reader.files if name.startswith(f"{folder}/")]
        found = EngineCheckpoint(reader.directory / folder, tag, files, False)
    if not found.files:
        raise CheckpointError(
            f"Checkpoint {reader.directory} holds no DeepSpeed engine state ({found.path.relative_to(reader.directory)}"
            "/): it was not saved under DeepSpeed."
        )
    return found


def resume_on_this_world(engine, state: StateByName, announce: bool = True) -> None:
    """Apply a ZeRO checkpoint read by :func:`read_zero_checkpoint` (saved on another number of processes) to
    ``engine`` (:func:`apply_zero_full_state`); with ``announce`` (the main process) say so in one info line."""
    apply_zero_full_state(engine, state)
    if announce:
        keys = sorted({key for entry in state.optimizer_state.values() for key in entry})
        get_logger("hasten.deepspeed").info(
            f"ZeRO-{state.stage} checkpoint {state.folder} was saved by {state.world_size} process(es) and is resumed "
            f"on {engine.dp_world_size} under ZeRO-{engine.zero_optimization_stage()}: its fp32 weights and optimizer "
            f"state ({', '.join(keys)}) of {len(state.weights)} parameters were partitioned again in memory."
        )


# ------------------------------------------------------------------------------------ reading


def _default_load(path, map_location=None):
    return safe_torch_load(path, path, map_location=map_location)


def _read(load: Callable, path: Path) -> dict:
    """One checkpoint file, through ``load``; a damaged file is a CheckpointError naming it."""
    try:
        return load(str(path), map_location="cpu")
    except CheckpointError:
        raise
    except Exception as error:
        raise CheckpointError(
            f"{path} cannot be read ({type(error).__name__}: {error}): the checkpoint is damaged or was not written "
            "completely. Nothing was loaded; resume from another checkpoint."
        ) from None


def read_zero_checkpoint(checkpoint_dir, load: Callable | None = None) -> StateByName:
    """Read a ZeRO (stage 1, 2 or 3) checkpoint saved on any number of processes into one state per parameter name.

    The optimizer files are read one at a time (memory: the full state plus one process's file); every file is
    read and checked before this returns, so a damaged, partial or inconsistent checkpoint raises here, before
    anything is applied.

    Args:
        checkpoint_dir: anything :func:`~hasten.strategies.deepspeed.checkpoint.find_deepspeed_checkpoint` accepts.
        load: reads one file: ``load(path, map_location=...)`` (default: ``torch.load(weights_only=True)`` allowing
            stand-ins for DeepSpeed's classes). The DeepSpeed strategy passes its reader, which checks each file
            against the checkpoint's manifest.

    Raises:
        CheckpointError: not a ZeRO checkpoint, a file missing, damaged or holding another layout than the others.
    """
    folder = find_deepspeed_checkpoint(checkpoint_dir)
    if folder is None:
        raise CheckpointError(
            f"{checkpoint_dir} holds no DeepSpeed checkpoint: expected a folder with *_model_states.pt files, a folder "
            "with a 'latest' file naming one, or a hasten checkpoint with a deepspeed/ folder."
        )
    load = load or _default_load
    model_files = _files(folder, "*_model_states.pt")
    optimizer_files = _files(folder, "*_optim_states.pt")
    model = _read(load, model_files[0])
    first = _read(load, optimizer_files[0])["optimizer_state_dict"]
    if "zero_stage" not in first:
        raise CheckpointError(
            f"{optimizer_files[0]} holds the state of DeepSpeed's bf16 optimizer of ZeRO stage 0, which hasten does "
            f"not partition again (only ZeRO stage 1-3 state). Resume on {len(optimizer_files)} processes; or merge "
            "the weights with `hasten merge-weights` and start this run from them (the optimizer state then starts "
            "afresh). Nothing was loaded."
        )
    stage = int(first["zero_stage"])
    world = first["partition_count"]
    world = max(world) if isinstance(world, list) else int(world)
    if world != len(optimizer_files):
        raise CheckpointError(
            f"{folder} should hold {world} *_optim_states.pt files (one per process) but holds "
            f"{len(optimizer_files)}: the checkpoint is incomplete. Nothing was loaded."
        )
    if int(model.get("mp_world_size", 1) or 1) != 1:
        raise CheckpointError(
            f"{folder} was saved with model (tensor or pipeline) parallelism ({model['mp_world_size']} model-parallel "
            "ranks); hasten partitions again only data-parallel ZeRO checkpoints. Nothing was loaded."
        )
    state = StateByName(stage=stage, world_size=world, folder=folder)
    state.buffers = {name: model["module"][name] for name in model.get("buffer_names") or [] if name in model["module"]}
    state.shared = dict(model.get("shared_params") or {})
    state.engine = {key: model.get(key) for key in _ENGINE_KEYS}
    state.scaler = {key: first.get(key) for key in _SCALER_KEYS}
    layout = _Layout(model["param_shapes"], stage, world, first)
    for name, shape in layout.shapes.items():
        state.weights[name] = torch.empty(shape, dtype=torch.float32)
    state.param_groups, keys = _param_groups(first, layout)
    for name in layout.shapes:
        state.optimizer_state[name] = {key: torch.empty(layout.shapes[name]) for key in keys}  # every value is read
    for rank, path in enumerate(optimizer_files):
        saved = first if rank == 0 else _read(load, path)["optimizer_state_dict"]
        layout.gather(rank, path, saved, state)
        first = saved = None  # one process's file in memory at a time
    state.weights.update(_frozen(model, model_files, stage, world, load))
    return state


def _param_groups(first: dict, layout: _Layout) -> tuple[list[dict], list[str]]:
    """The parameter groups (hyperparameters, parameter names) and the names of the split state's keys."""
    saved = first.get("base_optimizer_state", first.get("optimizer_state_dict"))
    if isinstance(saved, list):  # ZeRO-1/2 "elastic" layout: one state per group, no hyperparameters
        groups = [{"params": names} for names in layout.group_names(range(len(saved)))]
        step = first.get("base_optimizer_state_step")
        if step is not None:
            for group in groups:
                group["step"] = step
        states = saved
    else:
        groups = []
        for group in saved["param_groups"]:
            hyper = {key: value for key, value in group.items() if key != "params"}
            groups.append({**hyper, "params": layout.group_names(group["params"])})
        states = [saved["state"].get(index, {}) for group in saved["param_groups"] for index in group["params"]]
    keys = sorted({key for entry in states for key, value in entry.items() if layout.is_split(value)})
    return groups, keys


class _Layout:
    """Where each parameter's values lie in one saving process's flat vectors."""

    def __init__(self, param_shapes: list, stage: int, world: int, first: dict):
        self.stage, self.world = stage, world
        self.groups = [dict(group) for group in param_shapes]
        self.shapes = {name: tuple(shape) for group in self.groups for name, shape in group.items()}
        flats = first["single_partition_of_fp32_groups"] if stage <= 2 else first["fp32_flat_groups"]
        if len(flats) != len(self.groups):
            raise CheckpointError(
                f"the optimizer files hold {len(flats)} flat groups but the model file describes {len(self.groups)}: "
                "the checkpoint is inconsistent. Nothing was loaded."
            )
        paddings = first.get("group_paddings") or [0] * len(flats)
        self.partition = [flat.numel() + pad for flat, pad in zip(flats, paddings)]
        self.paddings = first.get("param_alignment_paddings")

    def group_names(self, indices) -> list[str]:
        return [name for index in indices for name in self.groups[index]]

    def is_split(self, value) -> bool:
        """Whether a saved state value is one process's slice of a flat vector (not a scalar like ``step``)."""
        return isinstance(value, torch.Tensor) and value.dim() == 1

    def segments(self, index: int, rank: int, length: int):
        """``(name, position in the flat slice, position in the parameter, count)`` of process ``rank``'s slice."""
        if self.stage >= 3:
            local = 0
            for name, shape in self.groups[index].items():
                numel = math.prod(shape)
                part = math.ceil(numel / self.world)
                count = max(0, min(part, numel - rank * part))
                if count:
                    yield name, local, rank * part, count
                local += part
            return
        start, offset = rank * self.partition[index], 0
        for position, (name, shape) in enumerate(self.groups[index].items()):
            numel = math.prod(shape)
            low, high = max(offset, start), min(offset + numel, start + length)
            if low < high:
                yield name, low - start, low - offset, high - low
            offset += numel + (self.paddings[index][position] if self.paddings else 0)

    def needed(self, index: int, rank: int) -> int:
        """How many values process ``rank``'s slice of flat group ``index`` must hold to cover its parameters."""
        if self.stage >= 3:
            return sum(math.ceil(math.prod(shape) / self.world) for shape in self.groups[index].values())
        paddings = self.paddings[index] if self.paddings else [0] * len(self.groups[index])
        total = sum(math.prod(shape) + pad for shape, pad in zip(self.groups[index].values(), paddings))
        total -= paddings[-1] if paddings else 0
        return max(0, min(self.partition[index], total - rank * self.partition[index]))

    def gather(self, rank: int, path: Path, saved: dict, state: StateByName) -> None:
        """Copy process ``rank``'s slices (fp32 weights, split optimizer state) into ``state``'s full tensors."""
        flats = saved["single_partition_of_fp32_groups"] if self.stage <= 2 else saved["fp32_flat_groups"]
        base = saved.get("base_optimizer_state", saved.get("optimizer_state_dict"))
        entries = base if isinstance(base, list) else [base["state"].get(i, {}) for i in range(len(flats))]
        if len(flats) != len(self.groups) or len(entries) != len(flats):
            raise CheckpointError(f"{path} holds another layout than the other processes' files. Nothing was loaded.")
        for index, flat in enumerate(flats):
            tensors = {"": flat, **{key: value for key, value in entries[index].items() if self.is_split(value)}}
            length, needed = flat.numel(), self.needed(index, rank)
            for key, tensor in tensors.items():
                if tensor.numel() < needed:
                    raise CheckpointError(
                        f"{path}: its slice of group {index} ({key or 'fp32 weights'}) holds {tensor.numel()} values, "
                        f"fewer than its parameters need; the checkpoint is corrupt. Nothing was loaded."
                    )
                for name, local, full, count in self.segments(index, rank, length):
                    target = state.weights[name] if not key else state.optimizer_state[name][key]
                    target.view(-1)[full : full + count] = tensor[local : local + count]
            if rank == 0:
                for name in self.groups[index]:
                    for key in state.optimizer_state[name].keys() - entries[index].keys():
                        del state.optimizer_state[name][key]  # this group had no such state when it was saved
                    for key, value in entries[index].items():
                        if not self.is_split(value):
                            state.optimizer_state[name][key] = value


def _frozen(model: dict, model_files: list[Path], stage: int, world: int, load: Callable) -> dict:
    """The weights of parameters that were not trained (kept whole under ZeRO-1/2, split under ZeRO-3)."""
    shapes = model.get("frozen_param_shapes") or {}
    if not shapes:
        return {}
    if stage <= 2:
        return {name: tensor.float() for name, tensor in (model.get("frozen_param_fragments") or {}).items()}
    pieces = {name: [] for name in shapes}
    for path in model_files[:world]:
        fragments = _read(load, path).get("frozen_param_fragments") or {}
        for name in shapes:
            pieces[name].append(fragments[name])
    return {name: torch.cat(pieces[name])[: math.prod(shape)].view(shape).float() for name, shape in shapes.items()}


# ------------------------------------------------------------------------------------ applying


def apply_zero_full_state(engine, state: StateByName) -> None:
    """Write a :class:`StateByName` into a live DeepSpeed ZeRO engine, on however many processes it runs.

    Every process takes its own slice of each full tensor: the fp32 master weights, the split optimizer state
    (``exp_avg``, ``exp_avg_sq``...), with the unsplit values (``step``) and the groups' hyperparameters as saved;
    the module's weights are set from the fp32 masters; then the buffers, the learning-rate scheduler, the engine's
    step counters and the loss scaler. Needs no collective. Everything is checked before anything is written.

    Args:
        engine: a ``deepspeed.DeepSpeedEngine`` under ZeRO stage 1, 2 or 3.
        state: what :func:`read_zero_checkpoint` returned (or a state built the same way).

    Raises:
        CheckpointError: parameter names, shapes or groups that differ from the engine's (naming
            the parameter), or an optimizer state kept on NVMe; nothing was changed.
    """
    optimizer = engine.optimizer
    names = {id(param): name for name, param in engine.module.named_parameters()}
    _check_matches(engine, state, names)
    groups = optimizer.optimizer.param_groups
    if engine.zero_optimization_stage() >= 3:
        slices = _zero3_slices(optimizer, names)
    else:
        slices = _zero12_slices(optimizer, names)
    for master, segments in slices:
        _fill(master, segments, state.weights)
        if segments:
            _set_optimizer_state(optimizer.optimizer.state[master], master, segments, state)
    for group, saved in zip(groups, state.param_groups):
        group.update({key: value for key, value in saved.items() if key != "params"})
    link_optimizer_views(engine)
    _set_module_weights(engine, state, names)
    _set_engine_state(engine, state)


def link_optimizer_views(engine) -> None:
    """Under ZeRO-1/2, point every parameter's view of its optimizer state (what ``safe_get_full_optimizer_state``
    reads) at the engine's state as it is now. DeepSpeed makes these views at its first step only: after a load they
    are missing until the next step, or, in a process that had stepped before, still point at the replaced state."""
    optimizer = engine.optimizer
    if engine.zero_optimization_stage() in (1, 2) and hasattr(optimizer, "_lazy_init_hp_params_optimizer_state"):
        optimizer._hp_optimizer_states_linked = False
        optimizer._lazy_init_hp_params_optimizer_state()


def _set_optimizer_state(moments: dict, master: torch.Tensor, segments: list, state: StateByName) -> None:
    """One flat group's optimizer state: split values sliced like the master, the others (``step``) as saved."""
    first = state.optimizer_state[segments[0][0]]
    for key, sample in first.items():
        if isinstance(sample, torch.Tensor) and sample.dim() >= 1:
            target = moments.get(key)
            if target is None or target.shape != master.shape:
                target = moments[key] = torch.zeros_like(master)
            _fill(target, segments, {name: state.optimizer_state[name][key] for name, *_ in segments})
        else:
            moments[key] = sample.clone() if isinstance(sample, torch.Tensor) else sample


def _check_matches(engine, state: StateByName, names: dict[int, str]) -> None:
    """Refuse a state whose parameters (names, shapes, groups) are not the engine's, before anything is written."""
    where = f"ZeRO checkpoint {state.folder}"
    if getattr(engine.optimizer, "swap_optimizer", False):
        raise CheckpointError(
            f"{where} cannot be partitioned again into an optimizer state kept on NVMe (offload_optimizer: nvme); "
            "resume on the number of processes that saved it, or offload to the CPU. Nothing was loaded."
        )
    live = dict(engine.module.named_parameters())
    for name in sorted(live.keys() - state.weights.keys()):
        raise CheckpointError(f"{where} has no parameter {name!r}, which the model has. Nothing was loaded.")
    for name in sorted(state.weights.keys() - live.keys()):
        raise CheckpointError(f"{where} holds parameter {name!r}, which the model does not have. Nothing was loaded.")
    for name, param in live.items():
        shape = tuple(getattr(param, "ds_shape", param.shape))
        if shape != tuple(state.weights[name].shape):
            raise CheckpointError(
                f"{where}: parameter {name!r} has shape {tuple(state.weights[name].shape)} in the checkpoint and "
                f"{shape} in the model. Nothing was loaded."
            )
        if param.requires_grad and name not in state.optimizer_state:
            raise CheckpointError(f"{where} holds no optimizer state for parameter {name!r}. Nothing was loaded.")
    groups = engine.optimizer.optimizer.param_groups
    if len(groups) != len(state.param_groups):
        raise CheckpointError(
            f"{where} holds {len(state.param_groups)} parameter groups; the optimizer has {len(groups)}. Create the "
            "optimizer with the same groups as the run that saved it. Nothing was loaded."
        )


def _zero12_slices(optimizer, names: dict[int, str]) -> list:
    """Per flat group: this process's fp32 slice and ``(name, position in slice, position in parameter, count)``."""
    import deepspeed.comm as dist

    result = []
    for index, master in enumerate(optimizer.single_partition_of_fp32_groups):
        rank = dist.get_rank(group=optimizer.real_dp_process_group[index])
        start, size = rank * master.numel(), master.numel()
        segments = []
        params = zip(optimizer.round_robin_bit16_groups[index], optimizer.round_robin_bit16_offsets[index])
        for param, offset in params:
            low, high = max(offset, start), min(offset + param.numel(), start + size)
            if low < high:
                segments.append((names[id(param)], low - start, low - offset, high - low))
        result.append((master, segments))
    return result


def _zero3_slices(optimizer, names: dict[int, str]) -> list:
    """As :func:`_zero12_slices` under ZeRO-3: each parameter's slice ``rank`` of ``partition_numel()`` values."""
    result = []
    for index, master in enumerate(optimizer.fp32_partitioned_groups_flat):
        segments = []
        for param in optimizer.fp16_groups[index]:
            _, local, part = optimizer.grad_position[optimizer.get_param_id(param)]
            rank = optimizer._get_param_partition_rank(param)
            count = max(0, min(part, param.ds_numel - rank * part))
            if count:
                segments.append((names[id(param)], local, rank * part, count))
        result.append((master, segments))
    return result


def _fill(target: torch.Tensor, segments: list, full: dict[str, torch.Tensor]) -> None:
    """Copy each segment of the full tensors into ``target``'s slice; the padding between them becomes zero."""
    flat = target.data.view(-1)
    end = 0
    for name, local, position, count in sorted(segments, key=lambda segment: segment[1]):
        flat[end:local].zero_()
        flat[local : local + count].copy_(full[name].reshape(-1)[position : position + count])
        end = local + count
    flat[end:].zero_()


def _set_module_weights(engine, state: StateByName, names: dict[int, str]) -> None:
    """The module's (low-precision) weights from the fp32 masters just written, frozen parameters from the state."""
    optimizer = engine.optimizer
    if engine.zero_optimization_stage() >= 3:
        for index, master in enumerate(optimizer.fp32_partitioned_groups_flat):
            optimizer.fp16_partitioned_groups_flat[index].data.copy_(master.data)
            flat = optimizer.fp16_partitioned_groups_flat[index]
            pieces = optimizer.unflatten(flat, optimizer.fp16_partitioned_groups[index])
            for partitioned, piece in zip(optimizer.fp16_partitioned_groups[index], pieces):
                partitioned.data = piece.data
        for name, param in engine.module.named_parameters():
            if not param.requires_grad:
                part = param.ds_tensor.numel()
                rank = optimizer._get_param_partition_rank(param)
                values = state.weights[name].reshape(-1)[rank * part : (rank + 1) * part]
                param.ds_tensor.data.zero_()
                param.ds_tensor.data[: values.numel()].copy_(values)
        return
    for name, param in engine.module.named_parameters():
        param.data.copy_(state.weights[name].to(param.dtype))


def _set_engine_state(engine, state: StateByName) -> None:
    """Buffers, learning-rate scheduler, step counters and loss scaler, as saved."""
    buffers = dict(engine.module.named_buffers())
    for name, value in state.buffers.items():
        if name in buffers:
            buffers[name].data.copy_(value)
    saved = state.engine
    if engine.lr_scheduler is not None and saved.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(saved["lr_scheduler"])
    for key in ("global_steps", "global_samples", "skipped_steps"):
        if saved.get(key) is not None:
            setattr(engine, key, saved[key])
    for key, value in state.scaler.items():
        if value is not None and hasattr(engine.optimizer, key) and not type(value).__module__.startswith("hasten."):
            setattr(engine.optimizer, key, value)
