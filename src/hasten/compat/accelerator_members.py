"""The rarely used members of Accelerate's ``Accelerator`` that hasten keeps for compatibility.

They live here so the facade stays about the training loop. The parallelism ranks read the
``ParallelismConfig``'s device mesh, and the sequence/context-parallel members ask the strategy; what hasten does
not implement (pipeline parallelism, Megatron-LM, ``torch_tp_plugin``, LOMO optimizers) answers with the values of a
pure data-parallel job, or raises :class:`~hasten.errors.NotSupportedError` when asked to act.
"""

from __future__ import annotations

from ..errors import NotSupportedError


def refuse_unsupported_plugins(torch_tp_plugin=None, megatron_lm_plugin=None, parallelism_config=None) -> None:
    """Raise ``NotSupportedError`` for ``Accelerator`` arguments naming engines hasten does not support."""
    if torch_tp_plugin is not None:
        raise NotSupportedError(
            "torch_tp_plugin is not supported by hasten; use parallelism_config=ParallelismConfig(tp_size=N) with a "
            "model that carries a _tp_plan."
        )
    if megatron_lm_plugin is not None:
        raise NotSupportedError("megatron_lm_plugin is not supported by hasten; use FSDP2 or DeepSpeed ZeRO.")
    if parallelism_config is not None and not hasattr(parallelism_config, "dp_shard_size"):
        raise NotSupportedError(
            f"parallelism_config must be a hasten.ParallelismConfig, got {type(parallelism_config).__name__}."
        )


class AcceleratorCompatibility:
    """Accelerate's compatibility members, mixed into ``Accelerator`` (which provides ``state``, ``_strategy``)."""

    @property
    def should_save_model(self) -> bool:
        """True on the process that writes a saved model (the main process); call ``save_model`` on every process."""
        return self.is_main_process

    @property
    def deepspeed_plugin(self):
        """The ``DeepSpeedPlugin`` in use (None without DeepSpeed)."""
        return self.state.deepspeed_plugin

    @property
    def fsdp_plugin(self):
        """The ``FullyShardedDataParallelPlugin`` in use (None without FSDP)."""
        return self.state.fsdp_plugin

    @property
    def fp8_backend(self) -> str:
        """``"AO"`` (torchao) when training in fp8, ``"NO"`` otherwise."""
        return "AO" if self.mixed_precision == "fp8" else "NO"

    @property
    def parallelism_config(self):
        """The :class:`~hasten.runtime.parallelism.ParallelismConfig` laying out the mesh (None without one)."""
        return self.state.parallelism_config

    @property
    def is_composable_parallelism_enabled(self) -> bool:
        """True when a ``ParallelismConfig`` lays out the processes on one mesh."""
        return self.state.parallelism_config is not None

    @property
    def torch_device_mesh(self):
        """The device mesh of the FSDP strategy (None for other strategies).

        With a ``ParallelismConfig`` its dimensions are the config's axes above 1 (of ``dp_replicate``,
        ``dp_shard``, ``cp``, ``sp``, ``tp``), and ``mesh["dp"]`` is the flattened data-parallel sub-mesh (None when
        every size is 1); with sequence parallelism every engine has one (``mesh["sp"].get_group()`` is the group
        Accelerate's loss recipe gathers over).
        """
        return getattr(self._strategy, "device_mesh", None)

    def _mesh_rank(self, name: str, default: int) -> int:
        from ..runtime.parallelism import data_parallel_mesh

        mesh = self.torch_device_mesh if self.state.parallelism_config is not None else None
        if mesh is None:
            return default
        if name == "dp":
            dp = data_parallel_mesh(mesh)
            return 0 if dp is None else dp.get_local_rank()
        return mesh[name].get_local_rank() if name in mesh.mesh_dim_names else 0

    @property
    def data_parallel_rank(self) -> int:
        """This process's rank among the data-parallel ranks (those reading different batches)."""
        return self._mesh_rank("dp", self.process_index)

    @property
    def data_parallel_shard_rank(self) -> int:
        """This process's rank in its sharding group."""
        return self._mesh_rank("dp_shard", self.process_index)

    @property
    def tensor_parallel_rank(self) -> int:
        """This process's rank among its tensor-parallel peers (0 without tensor parallelism)."""
        return self._mesh_rank("tp", 0)

    @property
    def pipeline_parallel_rank(self) -> int:
        """Always 0: no pipeline parallelism."""
        return 0

    @property
    def context_parallel_rank(self) -> int:
        """This process's rank among its context-parallel peers (0 without context parallelism)."""
        return self._mesh_rank("cp", 0)

    def maybe_context_parallel(self, buffers=None, buffer_seq_dims=None, no_restore_buffers=None):
        """Context parallel training for the block (torch's ``context_parallel`` over the ``cp`` ranks, FSDP2 on CUDA):
        ``buffers`` (inputs, labels, position ids, ...) are split along ``buffer_seq_dims`` for the block and restored
        after it, except ``no_restore_buffers``. Without ``cp_size`` above 1 it does nothing (a warning says so once),
        as in Accelerate. Enter it anew for each step."""
        return self._strategy.context_parallel(buffers, buffer_seq_dims, no_restore_buffers)

    def lomo_backward(self, loss, learning_rate: float) -> None:
        """LOMO/AdaLomo fused backward: not supported by hasten."""
        raise NotSupportedError(
            "lomo_backward (LOMO optimizers) is not supported by hasten; use accelerator.backward(loss) with a regular "
            "optimizer."
        )

    def deepspeed_ulysses_dl_adapter(self, dl, model):
        """``dl`` (prepared apart from ``model``, as transformers' Trainer does) split for the sequence parallelism of
        ``model``: DeepSpeed's ``UlyssesSPDataLoaderAdapter`` under ``sp_backend="deepspeed"``, hasten's adapter under
        ``"accelerate"``; ``dl`` itself without sequence parallelism. A loader already adapted is returned as it is
        (``prepare`` adapts the loaders it gets with the model)."""
        return self._strategy.sequence_parallel_loader(dl, model)
