"""A small causal transformer language model for `task.kind: lm`, written from scratch.

    model:
      kind: custom
      target: "user_models.transformer:TinyTransformer"
      args: {vocab_size: 32, width: 64, depth: 2, heads: 4, block_size: 64}
      block_size: 64        # the sequence length trainstack feeds: keep it equal
    data: {kind: markov, vocab_size: 32}   # the model's vocab_size must match

Token ids [B, T] -> logits [B, T, vocab_size]. Not trainstack's GPT: RMSNorm,
pre-norm blocks, rotary position embeddings inside attention (no position table),
SwiGLU MLPs, no biases anywhere, and an output head untied from the embedding.

Optional abilities trainstack uses: `pipeline_layers()` (the embedding, each block,
the head: each layer's output feeds the next, so a pipeline can cut between any two,
and activation checkpointing wraps the repeated blocks) and `flops_per_token()`
(for MFU; without it trainstack counts FLOPs once on one micro-batch).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

ROPE_BASE = 10_000.0
"""Rotary embedding base: pair i of a head turns at ROPE_BASE**(-2i / head_dim) per position."""


def rotate(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of queries or keys [B, heads, T, head_dim]: each pair of
    channels (i, i + head_dim/2) is turned by an angle proportional to the position."""
    seq_len, head_dim = x.shape[-2], x.shape[-1]
    half = head_dim // 2
    freqs = ROPE_BASE ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = torch.arange(seq_len, device=x.device, dtype=torch.float32)[:, None] * freqs
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class Attention(nn.Module):
    """Causal multi-head self-attention with rotary positions (SDPA, no biases)."""

    def __init__(self, width: int, *, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.proj = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (
            t.view(B, T, self.heads, C // self.heads).transpose(1, 2)
            for t in self.qkv(x).split(C, dim=-1)
        )
        y = F.scaled_dot_product_attention(rotate(q), rotate(k), v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class SwiGLU(nn.Module):
    """Gated MLP: down(silu(gate(x)) * up(x)), hidden size 8/3 × width rounded to 8."""

    def __init__(self, width: int) -> None:
        super().__init__()
        hidden = 8 * math.ceil(8 * width / 3 / 8)
        self.gate = nn.Linear(width, hidden, bias=False)
        self.up = nn.Linear(width, hidden, bias=False)
        self.down = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)); [B, T, C] -> [B, T, C]."""

    def __init__(self, width: int, *, heads: int) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(width)
        self.attn = Attention(width, heads=heads)
        self.mlp_norm = nn.RMSNorm(width)
        self.mlp = SwiGLU(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Head(nn.Module):
    """Final RMSNorm and the output projection: [B, T, C] -> logits [B, T, vocab_size]."""

    def __init__(self, width: int, *, vocab_size: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(width)
        self.out = nn.Linear(width, vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


class TinyTransformer(nn.Module):
    """Causal transformer LM: `forward(ids[B, T]) -> logits[B, T, vocab_size]`, T <= block_size."""

    def __init__(
        self,
        vocab_size: int,
        *,
        width: int = 64,
        depth: int = 2,
        heads: int = 4,
        block_size: int = 64,
    ) -> None:
        super().__init__()
        if width % heads != 0 or (width // heads) % 2 != 0:
            raise ValueError(
                f"width={width}, heads={heads}: heads must divide width into even head sizes"
            )
        self.block_size = block_size
        self.embed = nn.Embedding(vocab_size, width)
        self.blocks = nn.ModuleList(Block(width, heads=heads) for _ in range(depth))
        self.head = Head(width, vocab_size=vocab_size)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = (
                    0.02 / math.sqrt(2 * depth)
                    if name.endswith(("proj.weight", "down.weight"))
                    else 0.02
                )
                nn.init.normal_(p, mean=0.0, std=std)

    def pipeline_layers(self) -> list[nn.Module]:
        """The model as layers applied in order: the token embedding, each block, the head."""
        return [self.embed, *self.blocks, self.head]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.shape[1] > self.block_size:
            raise ValueError(f"{ids.shape[1]} tokens; this model takes at most {self.block_size}")
        x = ids
        for layer in self.pipeline_layers():
            x = layer(x)
        return x

    def flops_per_token(self) -> int:
        """Training FLOPs per token, forward + backward: 6 per weight of every matmul (2
        forward, 4 backward; the embedding is a lookup) plus 12 × depth × width ×
        block_size for attention's scores and weighted values (PaLM, appendix B)."""
        matmul_weights = sum(p.numel() for p in self.parameters() if p.dim() == 2)
        matmul_weights -= self.embed.weight.numel()
        attention = 12 * len(self.blocks) * self.embed.embedding_dim * self.block_size
        return 6 * matmul_weights + attention
