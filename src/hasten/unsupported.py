"""Public names of Accelerate that hasten does not support: they exist so imports work, and say so clearly when used."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import NotSupportedError


@dataclass
class ParallelismConfig:
    """Accelerate's N-D parallelism layout (data replicate/shard, tensor, context, sequence parallel sizes).

    hasten supports data parallelism (DDP), FSDP2 sharding and DeepSpeed ZeRO; tensor, context and sequence
    parallelism are not supported. A config whose only non-trivial size is ``dp_shard_size`` or
    ``dp_replicate_size`` is accepted (use ``FullyShardedDataParallelPlugin`` for sharding); any other
    size above 1 raises :class:`~hasten.errors.NotSupportedError`.
    """

    dp_replicate_size: int | None = None
    dp_shard_size: int | None = None
    tp_size: int | None = None
    cp_size: int | None = None
    cp_backend: str = "torch"
    sp_size: int | None = None
    sp_backend: str = "deepspeed"
    tp_handler: object = None
    cp_handler: object = None
    sp_handler: object = None

    def __post_init__(self):
        unsupported = {name: getattr(self, name) for name in ("tp_size", "cp_size", "sp_size") if (getattr(self, name) or 1) > 1}
        if unsupported:
            raise NotSupportedError(
                f"ParallelismConfig({', '.join(f'{k}={v}' for k, v in unsupported.items())}): tensor, context and sequence "
                "parallelism are not supported by hasten. Use FSDP2 (FullyShardedDataParallelPlugin) or DeepSpeed ZeRO."
            )


def prepare_pippy(model, split_points="auto", no_split_module_classes=None, example_args=(), example_kwargs=None, num_chunks=None, gather_output=False):
    """Pipeline-parallel inference (Accelerate's ``prepare_pippy``) is not supported by hasten."""
    raise NotSupportedError(
        "prepare_pippy (pipeline-parallel inference) is not supported by hasten. For a model larger than one device, "
        "use big-model inference: load_checkpoint_and_dispatch(model, checkpoint, device_map='auto')."
    )


def is_rich_available() -> bool:
    """Whether the ``rich`` package is installed (hasten does not install rich tracebacks)."""
    import importlib.util

    return importlib.util.find_spec("rich") is not None
