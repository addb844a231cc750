"""Ulysses attention, hasten's own (``ParallelismConfig(sp_backend="accelerate")``): a transformers model whose
sequences are split over the ``sp`` ranks computes its attention on whole sequences.

Each rank holds ``1/sp`` of every sequence with all the attention heads. Before the attention an all-to-all swaps
that for the whole sequence with ``1/sp`` of the heads; the model's own attention function (sdpa, flash attention,
a hub kernel) runs on it; a second all-to-all swaps back. Everything else in the model (embeddings, MLPs, norms, the
loss) runs on the rank's part of the sequence only, so activations take ``1/sp`` of the memory. Nothing here knows
an engine: DDP, FSDP2 and DeepSpeed (without DeepSpeed's own Ulysses) run the same module.

The wrapper is registered with transformers' ``AttentionInterface`` under a key of its own per model
(``hasten_ulysses_<n>``), which the model's text config names while it trains, so other models in the process keep
their attention. transformers builds no attention mask for such a key: the wrapper makes the one the whole sequence
needs from the gathered ``position_ids`` (causal, or causal within each packed document). In evaluation mode the model
names its own attention again (masks as without sequence parallelism): the loader gives each rank whole sequences
then (:mod:`hasten.data_loader.sequence_sharding`).
"""

from __future__ import annotations

import itertools
import weakref

import torch
import torch.distributed as dist

from ..errors import ConfigError

_KEYS = itertools.count()


def _exchange(tensor: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """All-to-all over ``group``: ``tensor`` split in ``world`` parts along ``scatter_dim`` (part ``j`` goes to rank
    ``j``), the parts received put side by side along ``gather_dim`` in rank order."""
    world = dist.get_world_size(group)
    shape = list(tensor.shape)
    parts = tensor.reshape(shape[:scatter_dim] + [world, shape[scatter_dim] // world] + shape[scatter_dim + 1 :])
    send = parts.movedim(scatter_dim, 0).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    shape[scatter_dim] //= world
    shape[gather_dim] *= world
    return received.movedim(0, gather_dim).reshape(shape)


class _AllToAll(torch.autograd.Function):
    """:func:`_exchange` with its inverse as the backward."""

    @staticmethod
    def forward(ctx, tensor, group, scatter_dim: int, gather_dim: int):
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _exchange(tensor, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _exchange(grad.contiguous(), ctx.group, gather_dim, scatter_dim), None, None, None


def all_to_all(tensor: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Differentiable all-to-all over ``group``: ``scatter_dim`` is divided by the group's size and ``gather_dim``
    multiplied by it (rank ``j``'s part at position ``j``)."""
    return _AllToAll.apply(tensor, group, scatter_dim, gather_dim)


class _PositionCache:
    """The whole sequences' ``position_ids`` (gathered over the ``sp`` group) and the mask they imply, worked out once
    per forward: every layer passes the same ``position_ids`` tensor, which a weak reference recognises (a new batch
    is a new tensor, even where the memory is reused)."""

    def __init__(self):
        self._source = None
        self.positions = None
        self.packed = False

    def update(self, local: torch.Tensor, group, world: int) -> None:
        if self._source is not None and self._source() is local:
            return
        parts = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(parts, local.contiguous(), group=group)
        positions = torch.cat(parts, dim=-1)
        chunk = local.shape[-1]
        local_ranges = torch.arange(chunk, device=local.device).expand(world, chunk).reshape(-1)
        if world > 1 and bool((positions == local_ranges).all()):
            raise ConfigError(
                f"Ulysses attention got position_ids 0..{chunk - 1} on every one of the {world} sequence-parallel "
                "ranks: the model made them for its part of the sequence (the batch carried none), or every rank got "
                "the whole sequence. Iterate the loader prepare() returned (it splits the batches and adds "
                "position_ids), or give each rank its part of the sequence with its global position_ids."
            )
        self.packed = bool((positions[..., 1:] == 0).any())
        self.positions = positions
        self._source = weakref.ref(local)


def _document_causal_mask(positions: torch.Tensor) -> torch.Tensor:
    """``[batch, 1, seq, seq]`` booleans: a token sees the tokens before it in its own packed document (a document
    starts where the position is 0)."""
    documents = (positions == 0).cumsum(-1)
    same = documents[:, :, None] == documents[:, None, :]
    seq = positions.shape[-1]
    return (same & torch.ones(seq, seq, dtype=torch.bool, device=positions.device).tril())[:, None]


class UlyssesAttention:
    """The attention function registered for one model: all-to-all, the model's attention, all-to-all back.

    Args:
        core: the attention function of transformers that runs on the whole sequence (``sdpa``, ``flash_attention_2``,
            ...), and ``core_name`` its name.
        group: the ``sp`` process group; ``kv_heads``: the model's key/value heads (replicated when fewer than the
            group's ranks, as DeepSpeed's Ulysses does).
    """

    def __init__(self, core, core_name: str, group, kv_heads: int):
        self.core, self.core_name, self.group = core, core_name, group
        self.world = dist.get_world_size(group)
        self.kv_repeats = max(self.world // kv_heads, 1)
        self._positions = _PositionCache()

    def __call__(self, module, query, key, value, attention_mask, *args, **kwargs):
        position_ids = kwargs.get("position_ids")
        if position_ids is None:
            raise ConfigError(
                "Ulysses attention needs the position_ids of the sequence part each rank holds; the model passed "
                "none to its attention. Use a transformers model that does (Llama, Qwen, Mistral, ...)."
            )
        self._positions.update(position_ids, self.group, self.world)
        kwargs["position_ids"] = self._positions.positions
        if self.kv_repeats > 1:
            key, value = (t.repeat_interleave(self.kv_repeats, dim=1) for t in (key, value))
        # [batch, heads, seq/sp, dim] -> [batch, heads/sp, seq, dim]
        query, key, value = (all_to_all(t, self.group, 1, 2) for t in (query, key, value))
        mask = None
        if self._positions.packed and "flash" not in self.core_name:
            mask = _document_causal_mask(self._positions.positions)
        groups = getattr(module, "num_key_value_groups", None)
        if groups is not None:
            module.num_key_value_groups = query.shape[1] // key.shape[1]
        try:
            output, weights = self.core(module, query, key, value, mask, *args, **kwargs)
        finally:
            if groups is not None:
                module.num_key_value_groups = groups
        # [batch, seq, heads/sp, dim] -> [batch, seq/sp, heads, dim]
        return all_to_all(output, self.group, 1, 2), weights


def install(model: torch.nn.Module, core_name: str, group, kv_heads: int) -> str:
    """Make ``model``'s text layers run :class:`UlyssesAttention` over ``group`` while it trains (its own attention
    ``core_name`` in evaluation mode); returns the key registered with transformers. A model already set up keeps its
    key."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    existing = getattr(model, "_hasten_ulysses_key", None)
    if existing is not None:
        return existing
    key = f"hasten_ulysses_{next(_KEYS)}"
    AttentionInterface.register(key, UlyssesAttention(ALL_ATTENTION_FUNCTIONS[core_name], core_name, group, kv_heads))
    config = model.config.get_text_config()

    def choose_attention(module, args, kwargs):
        config._attn_implementation = key if module.training else core_name

    model.register_forward_pre_hook(choose_attention, with_kwargs=True)
    model._hasten_ulysses_key = key
    config._attn_implementation = key if model.training else core_name
    return key
