"""Sequence parallelism under the DeepSpeed engine, as Accelerate 1.12+ runs it (``ParallelismConfig(sp_size=k)``).

With ``sp_backend="deepspeed"`` (the default under DeepSpeed) DeepSpeed's own pieces do the work, as in Accelerate:
``UlyssesSPAttentionHF.register_with_transformers`` puts DeepSpeed's Ulysses wrapper in place of the model's attention
function and makes the sequence-parallel groups (consecutive ranks; ZeRO runs over all ranks), the groups object goes
to ``deepspeed.initialize(mpu=...)``, and ``UlyssesSPDataLoaderAdapter`` wraps the loaders: every rank reads batches
of its own, and the ``sp`` ranks train on each other's in turn, each on its part of the sequence (``sp`` micro-batches
per batch read). With ``sp_backend="accelerate"`` the engine runs hasten's own Ulysses instead
(:mod:`hasten.runtime.ulysses`: the ``sp`` ranks read the same batches).

Differences from Accelerate, on purpose: a second ``Accelerator`` in the same process works (DeepSpeed's groups are
released and the attention function DeepSpeed wrapped is restored before they are made again; Accelerate fails on
DeepSpeed's "already initialized" assertion, or wraps the wrapper); the attention is the handler's
``sp_attn_implementation`` or else the model's own (Accelerate passes None on to DeepSpeed, which refuses it);
``torch_device_mesh`` has an ``sp`` dimension over DeepSpeed's groups' ranks (Accelerate's is None), so Accelerate's
documented loss recipe runs.
"""

from __future__ import annotations

import inspect

from ...errors import ConfigError, NotSupportedError
from ...runtime.sequence_parallel import check_model, sequence_parallel_of, settle_layout
from ...state import warn_once

# attention functions DeepSpeed's registration replaced, by name: put back before it registers again
_ORIGINAL_ATTENTION: dict = {}


def check_deepspeed_layout(config) -> None:
    """Refuse a ``ParallelismConfig`` the DeepSpeed engine does not run: tensor or context parallelism."""
    for axis in ("tp", "cp"):
        if getattr(config, f"{axis}_size") > 1:
            raise NotSupportedError(
                f"ParallelismConfig({axis}_size={getattr(config, f'{axis}_size')}) under DeepSpeed: hasten runs "
                "sequence parallelism (sp_size) with DeepSpeed, tensor and context parallelism with FSDP2. Use "
                "DeepSpeed's own tensor_parallel.autotp_size in its config, or the FSDP2 engine."
            )


class DeepSpeedSequenceParallel:
    """The sequence parallelism of one DeepSpeed strategy.

    Args:
        config: the :class:`~hasten.runtime.parallelism.ParallelismConfig` (``sp_size`` above 1).
        state: the ``AcceleratorState`` (world size, device).
    """

    def __init__(self, config, state):
        check_deepspeed_layout(config)
        settle_layout(config, "deepspeed", state.device.type)
        self.config, self.state, self.mpu = config, state, None
        self._mesh = None
        self._lay_out_data_parallel(state.num_processes)

    def _lay_out_data_parallel(self, world: int) -> None:
        """The data-parallel sizes of DeepSpeed's layout: ``world / sp_size`` ranks (Accelerate does not check the
        sizes given under DeepSpeed; sizes that do not fit are replaced, with a warning)."""
        config, split = self.config, self.config.sp_size
        if world % split:
            raise ConfigError(
                f"ParallelismConfig(sp_size={split}) under DeepSpeed on {world} processes: the sequence-parallel "
                f"groups take {split} consecutive ranks each, so sp_size must divide the number of processes."
            )
        replicas = config.dp_replicate_size
        if config.dp_shard_size is None and world % (split * replicas) == 0:
            config.dp_shard_size = world // (split * replicas)
        if config.dp_replicate_size * (config.dp_shard_size or 1) * split != world:
            warn_once(
                "deepspeed-sp-sizes",
                f"ParallelismConfig(dp_replicate_size={config.dp_replicate_size}, "
                f"dp_shard_size={config.dp_shard_size}, sp_size={split}) does not lay out the {world} processes; under "
                f"DeepSpeed the data-parallel ranks are the {world // split} groups of {split}, so hasten uses "
                f"dp_shard_size={world // split}.",
            )
            config.dp_replicate_size, config.dp_shard_size = 1, world // split

    @property
    def uses_deepspeed_ulysses(self) -> bool:
        """True for DeepSpeed's own Ulysses (``sp_backend="deepspeed"``), False for hasten's."""
        return self.config.sp_backend == "deepspeed"

    @property
    def mesh(self):
        """The layout's mesh (its ``sp`` dimension over the same ranks as DeepSpeed's groups)."""
        if self._mesh is None:
            self._mesh = self.config.get_device_mesh(self.state.device.type)
        return self._mesh

    @property
    def batch_processes(self) -> int:
        """The processes DeepSpeed multiplies the micro batch by for ``train_batch_size``: the data-parallel ranks with
        DeepSpeed's groups object, every rank without it."""
        world = self.state.num_processes
        return world // self.config.sp_size if self.uses_deepspeed_ulysses else world

    @property
    def data_parallel_world(self) -> tuple[int, int]:
        """(size, rank) the loaders are sharded by: every rank with DeepSpeed's adapter (each reads its own batches),
        the data-parallel ranks with hasten's (the ``sp`` ranks read the same batches)."""
        if self.uses_deepspeed_ulysses:
            return self.state.num_processes, self.state.process_index
        split = self.config.sp_size
        return self.state.num_processes // split, self.state.process_index // split

    def prepare(self, model, micro_batch_size: int, kwargs: dict) -> None:
        """Split ``model``'s sequences before ``deepspeed.initialize(**kwargs)``: DeepSpeed's Ulysses (its groups object
        goes into ``kwargs["mpu"]``) or hasten's."""
        mesh = self.mesh  # built here, on every rank at the same point (a mesh makes process groups)
        if not self.uses_deepspeed_ulysses:
            sequence_parallel_of(self.config, mesh).install(model)
            return
        self.mpu = _register(model, self.config, micro_batch_size)
        kwargs["mpu"] = self.mpu

    def loader(self, loader, model):
        """``loader`` split for this sequence parallelism (a loader already split is returned as it is)."""
        if not self.uses_deepspeed_ulysses:
            inner = getattr(model, "module", model)
            return sequence_parallel_of(self.config, self.mesh).adapt_loader(loader, inner)
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

        if isinstance(loader, UlyssesSPDataLoaderAdapter):
            return loader
        if self.mpu is None:
            raise ConfigError(
                "deepspeed_ulysses_dl_adapter needs the model prepared first: DeepSpeed's sequence-parallel groups are "
                "made when accelerator.prepare(model, ...) runs. Call it after preparing the model."
            )
        return UlyssesSPDataLoaderAdapter(
            loader,
            sp_rank=self.mpu.get_sequence_parallel_rank(),
            sp_group=self.mpu.get_sequence_parallel_group(),
            sp_world_size=self.mpu.get_sequence_parallel_world_size(),
            device=self.state.device,
        )


def _register(model, config, micro_batch_size: int):
    """DeepSpeed's ``UlyssesSPAttentionHF.register_with_transformers`` for ``model``, as Accelerate calls it (with
    ``disable_in_eval=True``); returns DeepSpeed's groups object."""
    import deepspeed
    from packaging.version import Version

    if Version(deepspeed.__version__) < Version("0.18.2"):
        raise ConfigError(
            f"DeepSpeed's Ulysses sequence parallelism needs deepspeed>=0.18.2 (installed: {deepspeed.__version__}): "
            "pip install -U deepspeed, or use sp_backend='accelerate' (hasten's own Ulysses)."
        )
    import deepspeed.runtime.sequence_parallel.parallel_state_sp as groups
    import torch.distributed as dist
    from deepspeed import comm
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if not comm.is_initialized():  # DeepSpeed's layer over the process group hasten made (initialize() does it later)
        comm.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)

    handler = config.sp_handler
    attention = check_model(model, config.sp_size, handler.sp_attn_implementation)
    model.config.get_text_config()._attn_implementation = attention
    ALL_ATTENTION_FUNCTIONS[attention] = _ORIGINAL_ATTENTION.setdefault(attention, ALL_ATTENTION_FUNCTIONS[attention])
    if getattr(groups, "_SEQUENCE_PARALLEL_GROUP", None) is not None:  # an earlier Accelerator's
        groups._SEQUENCE_PARALLEL_GROUP = groups._SEQUENCE_DATA_PARALLEL_GROUP = None
    options = {}
    if "disable_in_eval" in inspect.signature(UlyssesSPAttentionHF.register_with_transformers).parameters:
        options["disable_in_eval"] = True
    return UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model,
        core_attn_implementation=attention,
        sequence_parallel_size=config.sp_size,
        micro_batch_size=micro_batch_size,
        seq_length=handler.sp_seq_length,
        seq_length_is_variable=handler.sp_seq_length_is_variable,
        **options,
    )
