"""A small transformer-like model and data shared by the FSDP test scripts (imported, not run)."""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, SEQ, HEADS = 32, 16, 8, 2


class Block(nn.Module):
    """Pre-norm attention + MLP block."""

    def __init__(self):
        super().__init__()
        self.norm1 = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.norm2 = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, DIM)
        x = x + self.proj(attn)
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    """Embedding, two blocks, a head; ``_no_split_modules`` names the block class like Transformers models do."""

    _no_split_modules = ["Block"]

    def __init__(self, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.randn(SEQ, DIM) * 0.02)
        self.layers = nn.ModuleList(Block() for _ in range(layers))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)
        self.register_buffer("scale", torch.ones(()), persistent=False)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x)) * self.scale


def make_model(seed: int = 0) -> TinyTransformer:
    torch.manual_seed(seed)
    return TinyTransformer()


def batches(steps: int, batch: int = 4, rank: int = 0, world: int = 2):
    """Per-rank batches of token ids, the same on every run: step ``i`` of rank ``r`` is block ``i * world + r``."""
    generator = torch.Generator().manual_seed(1234)
    data = torch.randint(0, VOCAB, (steps * world, batch, SEQ + 1), generator=generator)
    return [data[i * world + rank] for i in range(steps)]


def loss_fn(model, tokens):
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
