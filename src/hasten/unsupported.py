"""Public names of Accelerate that hasten does not support: they exist so imports work, and say so clearly when used."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError, NotSupportedError


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
    cp_backend: str | None = None
    sp_size: int | None = None
    sp_backend: str | None = None
    tp_handler: object = None
    cp_handler: object = None
    sp_handler: object = None

    def __post_init__(self):
        self.device_mesh = None
        unsupported = {name: getattr(self, name) for name in ("tp_size", "cp_size", "sp_size") if (getattr(self, name) or 1) > 1}
        if unsupported:
            raise NotSupportedError(
                f"ParallelismConfig({', '.join(f'{k}={v}' for k, v in unsupported.items())}): tensor, context and sequence "
                "parallelism are not supported by hasten. Use FSDP2 (FullyShardedDataParallelPlugin) or DeepSpeed ZeRO."
            )


    def _mesh_dims(self) -> list[tuple[str, int]]:
        sizes = (("dp_replicate", self.dp_replicate_size or 1), ("dp_shard", self.dp_shard_size or 1))
        return [(name, size) for name, size in sizes if size > 1]

    def build_device_mesh(self, device_type: str):
        """A ``DeviceMesh`` over the data-parallel dimensions larger than 1 (``dp_replicate``, ``dp_shard``, and their
        flattened ``dp`` when both exist), or None when there is none. Needs the process group."""
        dims = self._mesh_dims()
        if not dims:
            return None
        from torch.distributed.device_mesh import init_device_mesh

        names, shape = zip(*dims)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
        if len(names) == 2:
            mesh[names]._flatten("dp")
        return mesh

    def get_device_mesh(self, device_type: str | None = None):
        """The mesh built by :meth:`build_device_mesh`, building it on first use (``device_type`` is then needed)."""
        if self.device_mesh is None:
            if device_type is None:
                raise ConfigError("ParallelismConfig.get_device_mesh: pass device_type (e.g. 'cuda') to build the mesh.")
            self.device_mesh = self.build_device_mesh(device_type)
        elif device_type is not None and self.device_mesh.device_type != device_type:
            raise ConfigError(f"ParallelismConfig: the device mesh was built for {self.device_mesh.device_type!r}, not {device_type!r}.")
        return self.device_mesh

    def to_json(self) -> str:
        """The sizes and backends as JSON (the handlers and the mesh are left out)."""
        fields = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "cp_backend", "sp_size", "sp_backend")
        return json.dumps({name: getattr(self, name) for name in fields})


def _refuse_parallelism(name: str) -> NotSupportedError:
    return NotSupportedError(
        f"{name}: tensor, context and sequence parallelism are not supported by hasten. Use FSDP2 "
        "(FullyShardedDataParallelPlugin) or DeepSpeed ZeRO (DeepSpeedPlugin) to fit a large model."
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


@dataclass
class TorchTensorParallelConfig:
    """Accelerate's TorchTensorParallelConfig (tensor/context/sequence parallelism); not supported by hasten (creating one raises NotSupportedError)."""

    enable_async_tp: Any = False

    def __post_init__(self):
        raise _refuse_parallelism("TorchTensorParallelConfig")


@dataclass
class TorchContextParallelConfig:
    """Accelerate's TorchContextParallelConfig (tensor/context/sequence parallelism); not supported by hasten (creating one raises NotSupportedError)."""

    cp_comm_strategy: Any = None

    def __post_init__(self):
        raise _refuse_parallelism("TorchContextParallelConfig")


@dataclass
class TorchTensorParallelPlugin:
    """Accelerate's TorchTensorParallelPlugin (tensor/context/sequence parallelism); not supported by hasten (creating one raises NotSupportedError)."""

    tp_size: Any = 1
    torch_device_mesh: Any = None

    def __post_init__(self):
        raise _refuse_parallelism("TorchTensorParallelPlugin")


@dataclass
class DeepSpeedSequenceParallelConfig:
    """Accelerate's DeepSpeedSequenceParallelConfig (tensor/context/sequence parallelism); not supported by hasten (creating one raises NotSupportedError)."""

    sp_seq_length: Any = None
    sp_seq_length_is_variable: Any = None
    sp_attn_implementation: Any = None

    def __post_init__(self):
        raise _refuse_parallelism("DeepSpeedSequenceParallelConfig")


def install_xla(upgrade=False):
    """Installing torch_xla (TPU support): not supported by hasten; raises NotSupportedError."""
    raise NotSupportedError("install_xla: TPUs (torch_xla) are not supported by hasten; it runs on CPUs and CUDA/XPU GPUs.")
