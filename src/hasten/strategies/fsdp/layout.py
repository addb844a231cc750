"""What a ``ParallelismConfig`` adds to FSDP2 beyond data parallelism: the mesh parameters are sharded over when
sequences are split (``sp``, ``cp``), hasten's Ulysses attention in the model (``sp``), and torch's ring attention for
the blocks ``accelerator.maybe_context_parallel`` opens (``cp``, CUDA).

The ``sp`` and ``cp`` ranks hold parts of the same sequences, so each one's gradients are a part of the batch's: FSDP2
shards over them with the data-parallel shard ranks (Accelerate's ``dp_shard_cp`` dimension), and its reduce-scatter
averages them as DDP averages the data-parallel ranks'.
"""

from __future__ import annotations

from ...errors import ConfigError
from ...runtime.sequence_parallel import sequence_parallel_of


def shard_mesh(config, mesh):
    """The mesh ``fully_shard`` shards over: the data-parallel dimensions, with ``dp_shard``, ``cp`` and ``sp``
    flattened into ``dp_shard_cp`` when sequences are split (``dp_replicate`` kept beside it for HSDP); None with one
    rank to shard over."""
    if not config.sequence_dim_names:
        dims = config.dp_dim_names
        return mesh[dims] if dims else None
    flat = mesh[config.dp_shard_cp_dim_names]._flatten("dp_shard_cp")
    if not config.dp_replicate_enabled:
        return flat
    return mesh[tuple(config.fsdp_dim_names)]


def split_sequences(config, mesh, model) -> None:
    """Put hasten's Ulysses attention into ``model`` when the layout splits sequences over ``sp`` (before it is
    sharded); with context parallelism, drop its attention masks as torch's ring attention needs."""
    sequence = sequence_parallel_of(config, mesh)
    if sequence is not None:
        sequence.install(model)
    if config is not None and config.cp_enabled:
        attach_context_parallel_hooks(model)


def attach_context_parallel_hooks(model) -> None:
    """Drop the attention mask of every ``*self_attn`` module's call and ask for causal attention instead, as
    Accelerate does under context parallelism (ring attention takes no mask). Models whose layers need a stricter mask
    (sliding-window, chunked attention) are refused: without their mask they would train on full causal attention."""
    config = getattr(model, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    kinds = getattr(config, "layer_types", None)
    stricter = (
        {kind for kind in kinds if kind != "full_attention"}
        if kinds is not None
        else ({"sliding_attention"} if getattr(config, "sliding_window", None) else set())
    )
    if stricter:
        raise ConfigError(
            f"Context parallelism computes full causal attention only, and {type(model).__name__} has attention layers "
            f"of type {sorted(stricter)}, whose mask it would drop. Use a full-attention model, or sequence "
            "parallelism (sp_size) instead."
        )

    def causal_instead_of_mask(module, args, kwargs):
        if "attention_mask" in kwargs:
            kwargs["attention_mask"] = None
            kwargs["is_causal"] = True
        return args, kwargs

    for name, module in model.named_modules():
        if name.endswith("self_attn"):
            module.register_forward_pre_hook(causal_instead_of_mask, with_kwargs=True, prepend=True)


def context_parallel(config, mesh, buffers, buffer_seq_dims, no_restore_buffers):
    """torch's ``context_parallel`` over the ``cp`` ranks with the handler's ``cp_comm_strategy`` (``allgather`` or
    ``alltoall``): ``buffers`` are split along ``buffer_seq_dims`` (load-balanced chunks) for the block."""
    from torch.distributed.tensor.experimental import context_parallel as ring
    from torch.distributed.tensor.experimental._attention import set_rotate_method

    set_rotate_method(config.cp_handler.cp_comm_strategy)
    return ring(mesh["cp"], buffers=buffers, buffer_seq_dims=buffer_seq_dims, no_restore_buffers=no_restore_buffers)
