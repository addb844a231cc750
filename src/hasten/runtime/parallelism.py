"""N-D parallelism: one ``ParallelismConfig`` lays every axis out on one ``DeviceMesh``.

The mesh has a dimension for each axis of size above 1, in the order ``dp_replicate``, ``dp_shard``, ``cp``,
``sp``, ``tp`` (Accelerate's layout: ``tp`` innermost, so tensor-parallel peers are neighbours, on GPUs the
same machine), and flattened sub-meshes: ``dp`` (the data-parallel ranks, which read different batches),
``dp_shard_cp`` (what FSDP shards over: ``dp_shard`` with the ``cp`` and ``sp`` ranks, which hold parts of the same
sequences) and ``dp_cp`` (the ranks gradients are averaged over). Tensor-parallel peers (``tp``) share a batch and
split each layer's weights; sequence-parallel peers (``sp``, Ulysses) and context-parallel peers (``cp``, ring
attention, CUDA only) share a batch and split its sequence. ``sp`` ranks are consecutive, as DeepSpeed's sequence
groups are.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from .. import environment
from ..errors import ConfigError, NotSupportedError
from ..settings.parallelism import PARALLELISM
from .parallelism_handlers import (
    DeepSpeedSequenceParallelConfig,
    TorchContextParallelConfig,
    TorchTensorParallelConfig,
    launch_option,
)

__all__ = [
    "SP_BACKENDS",
    "DeepSpeedSequenceParallelConfig",
    "ParallelismConfig",
    "TorchContextParallelConfig",
    "TorchTensorParallelConfig",
    "data_parallel_mesh",
]

MESH_ORDER = ("dp_replicate", "dp_shard", "cp", "sp", "tp")
# "deepspeed": DeepSpeed's ALST/Ulysses (the DeepSpeed engine only); "accelerate": hasten's own Ulysses, under any
# engine (the name Accelerate's development branch gives its own FSDP2/DDP backend).
SP_BACKENDS = ("deepspeed", "accelerate")
_SIZES = tuple(f"{axis}_size" for axis in MESH_ORDER)


def data_parallel_mesh(mesh):
    """The flattened ``dp`` (``dp_replicate`` x ``dp_shard``) sub-mesh of a mesh built by
    :meth:`ParallelismConfig.build_device_mesh`.

    None when the mesh (or ``mesh`` itself) is None or has no data-parallel dimension: every rank then reads the
    same batches. Flattening again returns the same mesh; reading it this way avoids torch's deprecation of
    slicing a flattened dimension from the root mesh (``mesh["dp"]``).
    """
    dims = [dim for dim in ("dp_replicate", "dp_shard") if mesh is not None and dim in (mesh.mesh_dim_names or ())]
    return mesh[dims]._flatten("dp") if dims else None


@dataclass
class ParallelismConfig:
    """Accelerate's N-D parallelism layout: data replicate / data shard / tensor / context / sequence sizes.

    Sizes left at None come from the launch settings (``--parallelism_config_dp_shard_size`` and the
    other ``parallelism_config_*`` flags or config file keys, carried as ``HASTEN_PARALLELISM_CONFIG_*``;
    Accelerate's ``PARALLELISM_CONFIG_*`` variables are read too), else 1; an unset ``dp_shard_size`` then
    takes the processes the other sizes leave when the mesh is built. An ``Accelerator`` needs the product
    of the sizes to equal the number of processes. ``dp_shard_size`` shards parameters (FSDP2),
    ``dp_replicate_size`` replicates the model (DDP) or its shards (HSDP), ``tp_size`` splits layers as the model's
    tensor-parallel plan says, ``sp_size`` splits each sequence over Ulysses attention (``sp_backend``: ``"deepspeed"``,
    DeepSpeed's, under the DeepSpeed engine; ``"accelerate"``, hasten's own, under DDP, FSDP2 or DeepSpeed; left
    unset, the engine decides), ``cp_size`` splits it over ring attention (FSDP2 on CUDA). See docs/parallelism.md.
    """

    dp_replicate_size: int | None = None
    dp_shard_size: int | None = None
    tp_size: int | None = None
    cp_size: int | None = None
    cp_backend: str | None = None
    sp_size: int | None = None
    sp_backend: str | None = None
    tp_handler: TorchTensorParallelConfig | None = None
    cp_handler: TorchContextParallelConfig | None = None
    sp_handler: DeepSpeedSequenceParallelConfig | None = None

    def __post_init__(self):
        self.device_mesh = None
        environment.fill_unset(self, PARALLELISM.rows)
        self.cp_backend = self.cp_backend or launch_option("cp_backend", "torch")
        # Accelerate's default; an engine settles a backend nobody chose (resolve_sp_backend)
        self._sp_backend_explicit = self.sp_backend is not None or launch_option("sp_backend") is not None
        self.sp_backend = self.sp_backend or launch_option("sp_backend", "deepspeed")
        for name in _SIZES:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(
                    f"ParallelismConfig({name}={value!r}): sizes are whole numbers of processes, at least 1."
                )
        if self.cp_backend != "torch":
            raise ConfigError(f"ParallelismConfig(cp_backend={self.cp_backend!r}): the only cp_backend is 'torch'.")
        if self.sp_backend not in SP_BACKENDS:
            raise ConfigError(
                f"ParallelismConfig(sp_backend={self.sp_backend!r}): sp_backend is 'deepspeed' (DeepSpeed's Ulysses, "
                "under the DeepSpeed engine) or 'accelerate' (hasten's own, under any engine)."
            )
        self._default_handlers()
        if self.cp_enabled and self.sp_enabled:
            raise ConfigError(
                f"ParallelismConfig(cp_size={self.cp_size}, sp_size={self.sp_size}): context and sequence parallelism "
                "are mutually exclusive; set one of them to 1."
            )
        self._check_pure_replication()

    def _default_handlers(self) -> None:
        if self.tp_enabled and self.tp_handler is None:
            self.tp_handler = TorchTensorParallelConfig()
        if self.cp_enabled:
            if self.cp_handler is None:
                self.cp_handler = TorchContextParallelConfig()
            elif not isinstance(self.cp_handler, TorchContextParallelConfig):
                raise ConfigError(
                    f"ParallelismConfig(cp_backend='torch') takes a TorchContextParallelConfig as cp_handler, "
                    f"got {type(self.cp_handler).__name__}."
                )
        if self.sp_enabled and self.sp_handler is None:
            self.sp_handler = DeepSpeedSequenceParallelConfig()

    def _check_pure_replication(self) -> None:
        if (self.tp_enabled or self.cp_enabled) and self.dp_replicate_enabled and self.dp_shard_size == 1:
            raise ConfigError(
                f"ParallelismConfig(dp_replicate_size={self.dp_replicate_size}, dp_shard_size=1) with tensor or "
                "context parallelism: replicas of a tensor-parallel model need a shard dimension. Set dp_shard_size > "
                "1 (FSDP x TP, or HSDP x TP with dp_replicate_size > 1)."
            )

    @classmethod
    def from_launch_settings(cls) -> ParallelismConfig | None:
        """The layout the launch settings ask for, or None when they set no ``parallelism_config_*`` size."""
        if not environment.any_set(PARALLELISM.rows):
            return None
        return cls()

    def sizes(self, world_size: int) -> dict[str, int]:
        """The size of each axis (``dp_replicate``, ``dp_shard``, ``cp``, ``sp``, ``tp``) for ``world_size`` processes,
        an unset ``dp_shard_size`` taking the processes the others leave; a :class:`ConfigError` when they do not
        fit."""
        others = self.dp_replicate_size * self.cp_size * self.sp_size * self.tp_size
        shard = self.dp_shard_size if self.dp_shard_size is not None else max(world_size // others, 1)
        sizes = {axis: shard if axis == "dp_shard" else getattr(self, f"{axis}_size") for axis in MESH_ORDER}
        product = others * shard
        if product != world_size:
            layout = ", ".join(f"{axis}_size={size}" for axis, size in sizes.items() if size > 1 or axis == "dp_shard")
            raise ConfigError(
                f"ParallelismConfig({layout}) lays out {product} processes, but {world_size} run. Make the product of "
                "the sizes equal the number of processes (--num_processes), or leave dp_shard_size unset to take the "
                "processes the other sizes leave."
            )
        return sizes

    def resolve_sp_backend(self, engine: str) -> str | None:
        """Settle ``sp_backend`` for the engine that trains (``"deepspeed"``, ``"fsdp"``, ``"ddp"``, ...), as
        Accelerate's development branch does: left unset, ``"deepspeed"`` under DeepSpeed and ``"accelerate"``
        otherwise; ``"deepspeed"`` asked for under another engine runs hasten's own Ulysses (``"accelerate"``), which
        needs no DeepSpeed. Returns a line saying so in that last case (else None)."""
        if not self.sp_enabled:
            return None
        if not self._sp_backend_explicit:
            self.sp_backend = "deepspeed" if engine == "deepspeed" else "accelerate"
        elif self.sp_backend == "deepspeed" and engine != "deepspeed":
            self.sp_backend = "accelerate"
            return (
                f"ParallelismConfig(sp_backend='deepspeed') needs the DeepSpeed engine; under {engine} the sequence is "
                "split by hasten's own Ulysses attention instead (sp_backend='accelerate'), with the same results."
            )
        return None

    def check_supported(self, device_type: str) -> None:
        """Raise :class:`NotSupportedError` for a layout that cannot run on ``device_type``: context parallelism off
        CUDA."""
        if self.cp_enabled and device_type != "cuda":
            raise NotSupportedError(
                f"ParallelismConfig(cp_size={self.cp_size}) on {device_type}: torch's context_parallel (ring "
                "attention) runs on CUDA only. On the CPU it fails inside scaled_dot_product_attention (torch 2.13: "
                "'Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy "
                "registered'). Split long sequences with sequence parallelism instead (sp_size, Ulysses), which runs "
                "on every device; see docs/parallelism.md."
            )

    def _get_mesh(self) -> tuple:
        """``(dimension names, shape)`` of the mesh: the axes of size above 1 in mesh order; ``()`` when there is
        none."""
        active = set(self.active_mesh_dims)
        axes = [
            (axis, self.dp_shard_size if axis == "dp_shard" else getattr(self, f"{axis}_size"))
            for axis in MESH_ORDER
            if axis in active
        ]
        return tuple(zip(*axes))

    def build_device_mesh(self, device_type: str):
        """The ``DeviceMesh`` of this layout over the initialised process group's ranks: one dimension per axis of
        size above 1, with the flattened ``dp``, ``dp_shard_cp`` and ``dp_cp`` sub-meshes where they have a
        dimension. None when no axis is above 1. An unset ``dp_shard_size`` is settled here from the number of
        processes. With DeepSpeed's sequence parallelism the mesh is built too (Accelerate builds none), over the
        ranks of DeepSpeed's own groups, so that ``mesh["sp"].get_group()`` (Accelerate's documented loss recipe)
        works under every backend."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if self.dp_shard_size is None:
            self.dp_shard_size = self.sizes(dist.get_world_size() if dist.is_initialized() else 1)["dp_shard"]
            self._check_pure_replication()
        mesh_layout = self._get_mesh()
        if not mesh_layout:
            return None
        names, shape = mesh_layout
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
        for dims, flat in (
            (self.dp_dim_names, "dp"),
            (self.dp_shard_cp_dim_names, "dp_shard_cp"),
            (self.dp_cp_dim_names, "dp_cp"),
        ):
            if dims:
                mesh[dims]._flatten(flat)
        return mesh

    def get_device_mesh(self, device_type: str | None = None):
        """The mesh built by :meth:`build_device_mesh`, building it on first use (``device_type`` is then needed)."""
        if self.device_mesh is None:
            if device_type is None:
                raise ConfigError(
                    "ParallelismConfig.get_device_mesh: pass device_type (e.g. 'cuda') to build the mesh."
                )
            self.device_mesh = self.build_device_mesh(device_type)
        elif device_type is not None and self.device_mesh.device_type != device_type:
            raise ConfigError(
                f"ParallelismConfig: the device mesh was built for {self.device_mesh.device_type!r}, not "
                f"{device_type!r}."
            )
        return self.device_mesh

    def to_json(self) -> str:
        """The sizes and backends as JSON (the handlers and the mesh are left out)."""
        fields = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "cp_backend", "sp_size", "sp_backend")
        return json.dumps({name: getattr(self, name) for name in fields})

    @property
    def dp_dim_names(self) -> list[str]:
        """The mesh dimensions whose ranks read different batches (``dp_replicate``, ``dp_shard``; those above 1)."""
        return [
            axis
            for axis, on in (("dp_replicate", self.dp_replicate_enabled), ("dp_shard", self.dp_shard_enabled))
            if on
        ]

    @property
    def non_dp_dim_names(self) -> list[str]:
        """The mesh dimensions whose ranks share a batch (``tp``, ``cp``, ``sp``; those above 1)."""
        return [axis for axis, on in (("tp", self.tp_enabled), ("cp", self.cp_enabled), ("sp", self.sp_enabled)) if on]

    @property
    def sequence_dim_names(self) -> list[str]:
        """The mesh dimensions whose ranks hold parts of the same sequences (``cp``, ``sp``; those above 1)."""
        return [axis for axis, on in (("cp", self.cp_enabled), ("sp", self.sp_enabled)) if on]

    @property
    def dp_shard_cp_dim_names(self) -> list[str]:
        """The mesh dimensions flattened into ``dp_shard_cp``, over which FSDP shards the model: ``dp_shard`` and the
        sequence dimensions (their ranks' gradients are parts of one sample's, which FSDP's reduce-scatter sums)."""
        return (["dp_shard"] if self.dp_shard_enabled else []) + self.sequence_dim_names

    @property
    def dp_cp_dim_names(self) -> list[str]:
        """The mesh dimensions flattened into ``dp_cp``, over which gradients are averaged: the data-parallel and the
        sequence dimensions."""
        return self.dp_dim_names + self.sequence_dim_names

    @property
    def fsdp_dim_names(self) -> list[str]:
        """The dimensions FSDP runs over: ``dp_replicate`` (when above 1) and the flattened ``dp_shard_cp``."""
        return (["dp_replicate"] if self.dp_replicate_enabled else []) + ["dp_shard_cp"]

    @property
    def active_mesh_dims(self) -> list[str]:
        """Every mesh dimension (axes of size above 1): the data-parallel ones, then the others."""
        return self.dp_dim_names + self.non_dp_dim_names

    @property
    def total_size(self) -> int:
        """The number of processes the sizes lay out (an unset ``dp_shard_size`` counting as 1)."""
        return self.data_parallel_size * self.non_data_parallel_size

    @property
    def data_parallel_size(self) -> int:
        """``dp_replicate_size`` x ``dp_shard_size``: the ranks that read different batches."""
        return self.dp_replicate_size * (self.dp_shard_size or 1)

    @property
    def non_data_parallel_size(self) -> int:
        """``tp_size`` x ``cp_size`` x ``sp_size``: the ranks that share each batch."""
        return self.tp_size * self.cp_size * self.sp_size

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
        """Whether sequences are split across context-parallel ranks (ring attention, CUDA only)."""
        return self.cp_size > 1

    @property
    def sp_enabled(self) -> bool:
        """Whether sequences are split across sequence-parallel ranks (Ulysses attention)."""
        return self.sp_size > 1
