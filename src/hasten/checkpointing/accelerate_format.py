"""Reading a checkpoint folder written by Accelerate 1.x's ``save_state``, without running pickled code.

Accelerate writes ``model[_<i>].safetensors`` (or ``pytorch_model[_<i>].bin``), ``optimizer[_<i>].bin``,
``scheduler[_<i>].bin``, ``scaler.pt``, ``custom_checkpoint_<i>.pkl`` and ``random_states_<rank>.pkl``,
all but the safetensors files through ``torch.save`` (pickle). :class:`AccelerateCheckpointReader`
presents such a folder through :class:`~hasten.checkpointing.CheckpointReader`'s interface, so
``load_state`` restores it with the same code as a hasten checkpoint; the next ``save_state`` writes
hasten's format.

Every pickle is read by ``torch.load(weights_only=True)``, whose unpickler builds only tensors,
storages, dtypes and plain containers; :data:`NUMPY_GLOBALS` adds the numpy array and dtype types
that numpy's random state holds. Anything else (a class, ``os.system``, ``open``...) is refused with a
:class:`~hasten.errors.CheckpointError` naming the file and the global, before it can run.
"""

from __future__ import annotations

import os
import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import CheckpointError
from ..runtime.weights.safetensors_io import read_header, read_tensors
from .files import MANIFEST, CheckpointReader


def _numpy_globals() -> list:
    core = np._core if hasattr(np, "_core") else np.core
    allowed: list = [
        core.multiarray._reconstruct,
        (core.multiarray._reconstruct, "numpy.core.multiarray._reconstruct"),
        np.ndarray,
        np.dtype,
    ]
    for code in "?bBhHiIlLqQefdg":
        kind = type(np.dtype(code))
        if kind is not np.dtype:
            allowed.append(kind)
    return allowed


NUMPY_GLOBALS = _numpy_globals()
"""The numpy functions and types a pickle may name besides torch's own safe ones (numpy arrays and dtypes)."""

_REFUSED = (
    re.compile(r"GLOBAL (\S+) (?:was not|whose module)"),
    re.compile(r"but got <class '([^']+)'>"),
    re.compile(r"unrecognized function (.+)$", re.M),
)


def _refused_name(error: Exception) -> str:
    text = str(error)
    for pattern in _REFUSED:
        match = pattern.search(text)
        if match:
            return match.group(1).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


def load_pickle(path: str | os.PathLike) -> Any:
    """Load a file written by ``torch.save`` (or plain pickle) without running code.

    Only tensors, storages, dtypes, numbers, strings, plain containers and numpy arrays are built.

    Raises:
        CheckpointError: the file names anything else (the message names the file and the global), or it
            is damaged.
    """
    path = Path(path)
    try:
        with torch.serialization.safe_globals(NUMPY_GLOBALS):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise CheckpointError(
            f"Refused to load {path}: its pickle refers to {_refused_name(error)}, which is not a tensor, number or "
            "plain container, and unpickling it could run code. Only load checkpoints you trust; if you trust this "
            "one, resave the object from the program that wrote it."
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as error:
        raise CheckpointError(
            f"{path} could not be read as a PyTorch file ({error}); it is truncated or damaged."
        ) from None


def is_accelerate_checkpoint(directory: str | os.PathLike) -> bool:
    """True for a folder written by Accelerate's ``save_state``: no hasten manifest, Accelerate's files."""
    directory = Path(directory)
    if (directory / MANIFEST).exists() or not directory.is_dir():
        return False
    return any(
        (directory / name).is_file()
        for name in ("random_states_0.pkl", "optimizer.bin", "model.safetensors", "pytorch_model.bin")
    )


def open_checkpoint(directory: str | os.PathLike, process_index: int = 0, models: list | None = None):
    """A reader for ``directory``: :class:`AccelerateCheckpointReader` for Accelerate's folders, else
    ``CheckpointReader``."""
    if is_accelerate_checkpoint(directory):
        return AccelerateCheckpointReader(directory, process_index, models or [])
    return CheckpointReader(directory)


def _suffix_index(stem: str, base: str) -> int | None:
    if stem == base:
        return 0
    match = re.fullmatch(rf"{base}_(\d+)", stem)
    return int(match.group(1)) if match else None


class AccelerateCheckpointReader:
    """An Accelerate checkpoint folder behind :class:`~hasten.checkpointing.CheckpointReader`'s interface.

    hasten's names are mapped to Accelerate's files: ``model_1.safetensors`` reads ``model_1.safetensors``
    or ``pytorch_model_1.bin``; the state ``optimizer_1`` reads ``optimizer_1.bin``; ``scheduler`` reads
    ``scheduler.bin``; ``scaler`` reads ``scaler.pt``; ``custom_checkpoint_0`` reads ``custom_checkpoint_0.pkl``;
    ``random_states_<rank>`` reads ``random_states_<rank>.pkl``, converted to hasten's layout. Accelerate
    keeps no loader positions (``dataloaders.json`` reads as none).

    Args:
        directory: the checkpoint folder.
        process_index: this process's rank (whose ``random_states_<rank>.pkl`` holds the step).
        models: the prepared models, whose tied weights Accelerate's safetensors files store once.
    """

    def __init__(self, directory: str | os.PathLike, process_index: int = 0, models: list | None = None):
        self.directory = Path(directory)
        self.models = list(models or [])
        self.files = {p.name: {"size": p.stat().st_size} for p in sorted(self.directory.iterdir()) if p.is_file()}
        self.parts: dict[str, Any] = {}  # Accelerate's folders have no states added after a publish
        self._states: dict[str, Any] = {}
        self._verified: set[str] = set()
        self._errors: dict[str, str] = {}
        rng = f"random_states_{process_index}.pkl"
        step = load_pickle(self.directory / rng).get("step", 0) if rng in self.files else 0
        self.manifest = {"format": "accelerate", "step": int(step or 0), "contents": self._contents()}
        self._warn_unread()

    def _count(self, *bases: str, ext: tuple[str, ...]) -> int:
        found = set()
        for name in self.files:
            stem, dot, extension = name.partition(".")
            for base in bases:
                index = _suffix_index(stem, base)
                if index is not None and dot and extension in ext:
                    found.add(index)
        return len(found)

    def _contents(self) -> dict[str, int]:
        contents = {
            "models": self._count("model", ext=("safetensors",)) or self._count("pytorch_model", ext=("bin",)),
            "optimizers": self._count("optimizer", ext=("bin",)),
            "schedulers": self._count("scheduler", ext=("bin",)),
            "custom_objects": sum(1 for name in self.files if re.fullmatch(r"custom_checkpoint_\d+\.pkl", name)),
        }
        return {kind: count for kind, count in contents.items() if count}

    def _warn_unread(self) -> None:
        unread = sorted(name for name in self.files if re.fullmatch(r"(sampler|dl_state_dict)(_\d+)?\.bin", name))
        if unread:
            warnings.warn(
                f"{self.directory} holds Accelerate's data loader states ({', '.join(unread)}); hasten does not read "
                "them, so the data loaders start from their beginning (skip the consumed batches with "
                "accelerator.skip_first_batches).",
                stacklevel=4,
            )

    def _path(self, *candidates: str) -> Path:
        for name in candidates:
            if name in self.files:
                return self.directory / name
        raise CheckpointError(
            f"Accelerate checkpoint {self.directory} has no {' or '.join(candidates)} (it holds: "
            f"{', '.join(sorted(self.files)[:12])}). Prepare (and register_for_checkpointing) the same objects, in the "
            "same order, as the run that saved it."
        )

    def _accelerate_names(self, name: str) -> list[str]:
        """Accelerate's file name(s) for a file name hasten's reader is asked for."""
        stem, _, extension = name.partition(".")
        if extension == "safetensors" and _suffix_index(stem, "model") is not None:
            index = _suffix_index(stem, "model")
            tail = "" if index == 0 else f"_{index}"
            return [name, f"pytorch_model{tail}.bin", f"pytorch_model_fsdp{tail}.bin"]
        if extension == "json" and stem.startswith("random_states_"):
            return [f"{stem}.pkl"]
        if extension == "json":
            return [
                f"{stem}.pt"
                if stem == "scaler"
                else f"{stem}.pkl"
                if stem.startswith("custom_checkpoint_")
                else f"{stem}.bin"
            ]
        return [name]

    def find_corrupt(self, names: list[str] | None = None, share: tuple[int, int] = (0, 1)) -> list[str]:
        """The files among ``names`` that cannot be read (``share`` ``(i, n)``: every n-th file from the i-th).
        Accelerate records no checksums, so verifying a file means reading it whole (pickles through the restricted
        unpickler); what was read is kept for the load."""
        bad = []
        for name in (sorted(self.files) if names is None else names)[share[0] :: share[1]]:
            if name in self._verified:
                continue
            try:
                self._read_file(self.directory / name)
            except CheckpointError as error:
                self._errors[name] = str(error)
                bad.append(name)
            self._verified.add(name)
        return bad

    def mark_verified(self, names) -> None:
        """Record that ``names`` were read whole by this process or another one sharing the folder."""
        self._verified.update(names)

    def verify(self, names: list[str] | None = None) -> None:
        """Read ``names`` (all files by default) whole; :class:`CheckpointError` names the first unreadable one."""
        bad = self.find_corrupt(names)
        if bad:
            raise CheckpointError(self._errors[bad[0]])

    def _read_file(self, path: Path) -> None:
        if path.suffix == ".safetensors":
            read_header(path)
        elif path.suffix in (".bin", ".pkl", ".pt"):
            load_pickle(path)

    def tensor_shapes(self, name: str) -> dict[str, tuple[int, ...] | None]:
        """The shape of every tensor of model file ``name`` (tied weights filled in)."""
        return {key: tuple(value.shape) for key, value in self.load_tensors(name).items()}

    def param_group_keys(self, name: str) -> list[list] | None:
        """What each group of saved optimizer ``name`` lists under ``params`` (positions or parameter names)."""
        groups = self.load_state(name).get("param_groups")
        return [list(group.get("params", [])) for group in groups] if isinstance(groups, list) else None

    def param_group_sizes(self, name: str) -> list[int] | None:
        """The number of parameters in each group of saved optimizer ``name``."""
        keys = self.param_group_keys(name)
        return None if keys is None else [len(group) for group in keys]

    def exists(self, name: str) -> bool:
        """True when the folder holds Accelerate's file for hasten's file ``name``."""
        return name == "dataloaders.json" or any(candidate in self.files for candidate in self._accelerate_names(name))

    def load_tensors(self, name: str, into: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The tensors of model file ``name`` (safetensors, or a ``.bin`` read without running code); ``into`` is
        accepted for :class:`CheckpointReader`'s interface (the caller copies into its live tensors)."""
        path = self._path(*self._accelerate_names(name))
        if path.suffix == ".safetensors":
            tensors = dict(read_tensors(read_header(path)))
        else:
            tensors = load_pickle(path)
            if not isinstance(tensors, dict) or not all(isinstance(v, torch.Tensor) for v in tensors.values()):
                raise CheckpointError(f"{path} does not hold a state dict (names to tensors).")
        index = _suffix_index(name.partition(".")[0], "model")
        if index is not None and index < len(self.models):
            _fill_tied(tensors, self.models[index])
        return tensors

    def load_json(self, name: str) -> Any:
        """Only ``dataloaders.json`` is asked for by name: Accelerate keeps no loader positions."""
        if name == "dataloaders.json":
            return []
        raise CheckpointError(f"Accelerate checkpoint {self.directory} has no {name!r}.")

    def load_state(self, name: str, into: Any = None) -> Any:
        """The state hasten calls ``name`` (``optimizer``, ``scheduler_1``, ``random_states_0``...), read from
        Accelerate's file."""
        if name not in self._states:
            path = self._path(*self._accelerate_names(f"{name}.json"))
            state = load_pickle(path)
            self._states[name] = rng_states_from_accelerate(state, path) if name.startswith("random_states_") else state
        return self._states[name]


def _fill_tied(tensors: dict[str, torch.Tensor], model: torch.nn.Module) -> None:
    """Put back the tied weights Accelerate's safetensors files store under one of their names only."""
    from ..runtime.weights.tied import find_tied_parameters
    from ..runtime.wrappers import extract_model_from_parallel

    for group in find_tied_parameters(extract_model_from_parallel(model, keep_torch_compile=False)):
        present = [name for name in group if name in tensors]
        for name in group:
            if present and name not in tensors:
                tensors[name] = tensors[present[0]]


def rng_states_from_accelerate(states: Any, path: Path) -> dict[str, Any]:
    """Accelerate's ``random_states_<rank>.pkl`` contents in :func:`hasten.runtime.rng.restore_rng_states`'s layout."""
    try:
        py_version, py_state, py_gauss = states["random_state"]
        kind, keys, pos, has_gauss, cached = states["numpy_random_seed"]
        meta = {
            "python": {"version": int(py_version), "state": [int(v) for v in py_state], "gauss": py_gauss},
            "numpy": {
                "kind": str(kind),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached),
            },
        }
        tensors = {
            "torch": states["torch_manual_seed"],
            "numpy_keys": torch.from_numpy(np.asarray(keys, dtype=np.uint32).astype(np.int64)),
        }
    except (KeyError, TypeError, ValueError) as error:
        raise CheckpointError(
            f"{path} does not hold Accelerate's random states (python, numpy, torch): {error!r}."
        ) from None
    for device in ("cuda", "xpu"):
        for i, state in enumerate(states.get(f"torch_{device}_manual_seed") or []):
            tensors[f"{device}_{i}"] = state
    return {"meta": meta, "tensors": tensors}
