"""A tiny language model and a learnable token stream shared by the fp8 tests (imported, not run).

Every linear layer has sizes that are multiples of 16, so the float8 filter keeps exactly the first one
(``blocks.0.qkv``) and the last one (``head``) in high precision. The stream follows ``next = (5 * token + 3) % VOCAB``
from a random start, so the loss falls from ln(VOCAB) towards 0 within a few dozen steps.
"""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, SEQ, HEADS = 32, 32, 16, 2


class Block(nn.Module):
    """Pre-norm causal attention + MLP."""

    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.fc, self.out = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, DIM))
        return x + self.out(F.gelu(self.fc(self.norm2(x))))


class TinyLM(nn.Module):
    """Token and position embeddings, ``layers`` blocks, a head."""

    def __init__(self, layers: int = 1):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, DIM), nn.Embedding(SEQ, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB)

    def forward(self, idx):
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def batch(size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of ``size`` sequences of the stream."""
    tokens = [torch.randint(0, VOCAB, (size, 1), generator=generator)]
    for _ in range(SEQ):
        tokens.append((tokens[-1] * 5 + 3) % VOCAB)
    stream = torch.cat(tokens, dim=1)
    return stream[:, :-1], stream[:, 1:]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
