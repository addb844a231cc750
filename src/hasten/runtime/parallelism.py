"""N-D parallelism: one ``ParallelismConfig`` lays every axis out on one ``DeviceMesh``.

The mesh has the dimensions ``("dp_replicate", "dp_shard", "tp")`` (sizes of 1 included, so every
name always exists) and a flattened ``"dp"`` sub-mesh (``dp_replicate`` x ``dp_shard``): the
data-parallel ranks, which read different batches. Tensor-parallel peers (``"tp"``) share a batch
and split each layer's weights. Ranks are laid out with ``tp`` innermost, so tensor-parallel peers
are neighbours (on GPUs: the same machine).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .. import environment
from ..errors import ConfigError, NotSupportedError
from ..settings.parallelism import PARALLELISM

MESH_DIMS = ("dp_replicate", "dp_shard", "tp")


def data_parallel_mesh(mesh):
    """The flattened ``dp`` (``dp_replicate`` x ``dp_shard``) sub-mesh of a mesh built by :meth:`ParallelismConfig.build_device_mesh`.

    Flattening again returns the same mesh; reading it this way avoids torch's deprecation of
    slicing a flattened dimension from the root mesh (``mesh["dp"]``).
    """
    return mesh["dp_replicate", "dp_shard"]._flatten("dp")


@dataclass
class ParallelismConfig:
    """Accelerate's N-D parallelism layout: data replicate / data shard / tensor / context / sequence sizes.

    Sizes left at None come from the launch settings (``--parallelism_config_dp_shard_size`` and the
    other ``parallelism_config_*`` flags or config file keys, carried as ``HASTEN_PARALLELISM_CONFIG_*``),
    else 1; an unset ``dp_shard_size`` then takes the processes the other sizes leave. The product of
    the sizes must equal the number of processes. ``dp_shard_size`` shards parameters (FSDP2),
    ``dp_replicate_size`` replicates the shards (HSDP), ``tp_size`` splits layers as the model's
    tensor-parallel plan says. Context and sequence parallelism (``cp_size``/``sp_size`` above 1)
    raise :class:`~hasten.errors.NotSupportedError` (see docs/parallelism.md).
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
        self.cp_backend = self.cp_backend or "torch"
        self.sp_backend = self.sp_backend or "deepspeed"
        environment.fill_unset(self, PARALLELISM.rows)
        for name in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(f"ParallelismConfig({name}={value!r}): sizes are whole numbers of processes, at least 1.")
        unsupported = {name: getattr(self, name) for name in ("cp_size", "sp_size") if getattr(self, name) > 1}
        if unsupported:
            raise NotSupportedError(
                f"ParallelismConfig({', '.join(f'{k}={v}' for k, v in unsupported.items())}): context and sequence parallelism "
                "are not supported by hasten (torch's context_parallel needs CUDA scaled-dot-product attention kernels). "
                "Use dp_shard_size and tp_size to fit long sequences, or activation checkpointing; see docs/parallelism.md."
            )

    @classmethod
    def from_launch_settings(cls) -> ParallelismConfig | None:
        """The layout the launch settings ask for, or None when they set no ``parallelism_config_*`` size."""
        if not environment.any_set(PARALLELISM.rows):
            return None
        return cls()

    def sizes(self, world_size: int) -> dict[str, int]:
        """The size of each mesh dimension for ``world_size`` processes; a :class:`ConfigError` when they do not fit."""
        others = self.dp_replicate_size * self.tp_size
        shard = self.dp_shard_size if self.dp_shard_size is not None else world_size // others
        sizes = {"dp_replicate": self.dp_replicate_size, "dp_shard": max(shard, 1), "tp": self.tp_size}
        product = sizes["dp_replicate"] * sizes["dp_shard"] * sizes["tp"]
        if product != world_size:
            raise ConfigError(
                f"ParallelismConfig(dp_replicate_size={sizes['dp_replicate']}, dp_shard_size={sizes['dp_shard']}, tp_size={sizes['tp']}) "
                f"lays out {product} processes, but {world_size} run. Make the product of the sizes equal the number of processes "
                "(--num_processes), or leave dp_shard_size unset to take the processes the other sizes leave."
            )
        return sizes

    def build_device_mesh(self, device_type: str):
        """The ``DeviceMesh`` of this layout over the initialised process group's ranks, with the dimensions
        ``dp_replicate``, ``dp_shard``, ``tp`` and the flattened ``dp``."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        sizes = self.sizes(dist.get_world_size() if dist.is_initialized() else 1)
        mesh = init_device_mesh(device_type, tuple(sizes[d] for d in MESH_DIMS), mesh_dim_names=MESH_DIMS)
        data_parallel_mesh(mesh)
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

    @property
    def tp_enabled(self) -> bool:
        """Whether layers are split across tensor-parallel ranks."""
        return self.tp_size > 1

    @property
    def dp_shard_enabled(self) -> bool:
        """Whether parameters are sharded across data-parallel ranks."""
        return (self.dp_shard_size or 1) > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        """Whether the (sharded) model is replicated across groups of ranks."""
        return self.dp_replicate_size > 1

    @property
    def cp_enabled(self) -> bool:
        """Always False: context parallelism is refused at construction."""
        return False

    @property
    def sp_enabled(self) -> bool:
        """Always False: sequence parallelism is refused at construction."""
        return False

    @property
    def total_size(self) -> int:
        """The number of processes the explicitly set sizes lay out."""
        return self.dp_replicate_size * (self.dp_shard_size or 1) * self.tp_size * self.cp_size * self.sp_size


@dataclass
class TorchTensorParallelConfig:
    """Accelerate's tensor-parallel options, given as ``ParallelismConfig(tp_handler=...)``.

    Asynchronous tensor parallelism (``enable_async_tp=True``, CUDA symmetric memory) is not supported
    and raises :class:`~hasten.errors.NotSupportedError`; plain tensor parallelism needs no options.
    """

    enable_async_tp: Any = False

    def __post_init__(self):
        if self.enable_async_tp:
            raise NotSupportedError(
                "TorchTensorParallelConfig(enable_async_tp=True): asynchronous tensor parallelism is not supported by hasten; "
                "leave it False (tensor parallelism itself works: ParallelismConfig(tp_size=N))."
            )
