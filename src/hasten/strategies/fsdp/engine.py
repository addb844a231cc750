"""The registration of the FSDP2 engine, with the N-D layout (``ParallelismConfig``) it runs.

A ``ParallelismConfig`` is a layout, not an engine: under FSDP2 it lays out the mesh (``dp_replicate``, ``dp_shard``,
the tensor-parallel split FSDP2 shards on top of, and the sequence splits ``sp``/``cp``). DDP and DeepSpeed take it
too (sequence parallelism), so it is a ``layout`` argument of all three: it goes to the engine asked for otherwise,
and, when none is, chooses FSDP2 unless it only splits sequences (DDP then).

Imports nothing but the settings tables (see :mod:`hasten.settings.engines`).
"""

from __future__ import annotations

from pathlib import Path

from ...settings.dialogue import ask_table
from ...settings.engines import Argument, CheckpointReading, Dialogue, Engine, WeightsMerge
from ...settings.fsdp import FSDP
from ...settings.parallelism import PARALLELISM, asks_for_fsdp


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


def _holds_shards(reader, index: int) -> bool:
    """Whether model ``index`` of an open checkpoint is kept as FSDP2 shards."""
    from .other_engines import holds_shards

    return holds_shards(reader, index)


def _read_shards(reader, index: int, module):
    """Model ``index``'s FSDP2 shards by parameter name, for a resume under another engine."""
    from .other_engines import read_shards

    return read_shards(reader, index, module)


ENGINE = Engine(
    name="fsdp",
    strategy="hasten.strategies.fsdp.strategy:FSDPStrategy",
    distributed_types=("FSDP",),
    arguments=(
        Argument("fsdp_plugin", "hasten.strategies.fsdp.plugin:FullyShardedDataParallelPlugin", FSDP),
        Argument(
            "parallelism_config",
            "hasten.runtime.parallelism:ParallelismConfig",
            PARALLELISM,
            from_launch=True,
            layout=asks_for_fsdp,
        ),
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
    checkpoint_reading=CheckpointReading(_holds_shards, _read_shards),
)
