"""Debug mode for collectives: fail fast with a clear message instead of hanging.

Enabled by ``HASTEN_DEBUG_MODE=1`` (also under plain torchrun), ``hasten launch --debug`` or
``debug: true`` in the launch config. Before each collective of :mod:`hasten.runtime.operations` every rank
exchanges the operation's name, its sequence number and its input shapes; a mismatch raises
:class:`~hasten.errors.DistributedOperationException` on every rank, listing each process's shapes.

A collective that never completes is reported in every mode, debug or not, by
:mod:`hasten.runtime.hang_watchdog` (``HASTEN_HANG_TIMEOUT``).
"""

from __future__ import annotations

import torch.distributed as dist

from .. import environment
from . import hang_watchdog
from ..errors import DistributedOperationException

_SHAPE_FREE = {"gather_object", "broadcast_object_list", "wait_for_everyone"}


_enabled: bool | None = None  # set by the process state when it starts (configure); None: read the environment


def configure(enabled: bool | None) -> None:
    """Turn debug mode on or off for this process (the state does it when it starts; None: follow ``HASTEN_DEBUG_MODE``)."""
    global _enabled
    _enabled = enabled


def active() -> bool:
    """True when collectives should be checked: debug mode is on and several processes run."""
    enabled = _enabled if _enabled is not None else environment.get_flag("DEBUG_MODE")
    return enabled and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _describe(name: str, args, kwargs):
    if name in _SHAPE_FREE or not args:
        return None
    from .tree import _leaves, get_shape

    data = args[0]
    if not any(True for _ in _leaves(data)):
        return None
    return get_shape(data)


def check(name: str, args, kwargs) -> None:
    """Verify that every rank calls ``name`` (as its same numbered collective) with compatible inputs."""
    seq = hang_watchdog.sequence()
    payload = (name, seq, _describe(name, args, kwargs))
    everyone: list = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(everyone, payload)
    except RuntimeError as error:
        raise DistributedOperationException(
            f"Operation `hasten.runtime.operations.{name}` (collective #{seq}) failed while the ranks compared their "
            f"inputs: {error}\nWhere the other ranks are:\n{hang_watchdog.peers()}"
        ) from error
    _compare(name, everyone)


def _compare(name: str, everyone: list) -> None:
    names = {entry[0] for entry in everyone}
    seqs = {entry[1] for entry in everyone}
    if len(names) > 1 or len(seqs) > 1:
        listing = "\n".join(f"  - Process {i}: `{e[0]}` (collective #{e[1]})" for i, e in enumerate(everyone))
        raise DistributedOperationException(
            "Cannot apply desired operation: the processes called different collectives. Every process must call "
            f"the same collectives in the same order.\n\nOperation: `hasten.runtime.operations.{name}`\nCalls:\n{listing}"
        )
    shapes = [entry[2] for entry in everyone]
    if name == "pad_across_processes":
        shapes = [_ranks_only(s) for s in shapes]
    if any(s != shapes[0] for s in shapes):
        listing = "\n".join(f"  - Process {i}: {_fmt(e[2])}" for i, e in enumerate(everyone))
        raise DistributedOperationException(
            "Cannot apply desired operation due to shape mismatches. All shapes across devices must be valid.\n\n"
            f"Operation: `hasten.runtime.operations.{name}`\nInput shapes:\n{listing}"
        )


def _ranks_only(shape_structure):
    from .tree import recursively_apply

    return recursively_apply(lambda s: len(s), shape_structure, test_type=lambda x: isinstance(x, list) and all(isinstance(i, int) for i in x))


def _fmt(structure) -> str:
    return str(structure) if structure is not None else "(no tensors)"
