"""The registration of the FSDP2 engine, with the N-D layout (``ParallelismConfig``) it runs.

A ``ParallelismConfig`` is an FSDP setting, not an engine: it lays out FSDP2's mesh (``dp_replicate``, ``dp_shard``)
and the tensor-parallel split that FSDP2 shards on top of; it has no strategy of its own and cannot be combined
with another engine. So it is FSDP's second argument: given to ``Accelerator(parallelism_config=...)`` or set by
the launch's ``parallelism_config_*`` settings, it chooses FSDP.

Imports nothing but the settings tables (see :mod:`hasten.settings.engines`).
"""

from __future__ import annotations

from pathlib import Path

from ...settings.dialogue import ask_table
from ...settings.engines import Argument, Dialogue, Engine, WeightsMerge
from ...settings.fsdp import FSDP
from ...settings.parallelism import PARALLELISM


def _ask(ask, answers: dict) -> dict:
    """The FSDP questions of ``hasten config``."""
    return {FSDP.name: ask_table(ask, FSDP)}


def _holds(folder: Path) -> bool:
    """Whether ``folder`` (or one of its subfolders) is a ``torch.distributed.checkpoint`` folder."""
    return (folder / ".metadata").is_file() or any(
        (child / ".metadata").is_file() for child in folder.iterdir() if child.is_dir()
    )


def _merge(folder, output, safe_serialization: bool, max_shard_size: str) -> list:
    """The full state dict of an FSDP sharded checkpoint, written to ``output``."""
    from .merging import merge_fsdp_weights

    return merge_fsdp_weights(folder, output, safe_serialization=safe_serialization)


ENGINE = Engine(
    name="fsdp",
    strategy="hasten.strategies.fsdp.strategy:FSDPStrategy",
    distributed_types=("FSDP",),
    arguments=(
        Argument("fsdp_plugin", "hasten.strategies.fsdp.plugin:FullyShardedDataParallelPlugin", FSDP),
        Argument("parallelism_config", "hasten.runtime.parallelism:ParallelismConfig", PARALLELISM, from_launch=True),
    ),
    sections=(PARALLELISM, FSDP),
    switch="USE_FSDP",
    switch_help="use the FSDP2 strategy",
    flag_help="Use fully sharded data parallel (FSDP2).",
    dialogue=Dialogue("Do you want to use FullyShardedDataParallel?", ("MULTI_GPU", "MULTI_XPU"), _ask),
    merge_weights=WeightsMerge(
        "FSDP",
        "an FSDP sharded checkpoint (a torch.distributed.checkpoint folder with a .metadata file)",
        _holds,
        _merge,
    ),
)
