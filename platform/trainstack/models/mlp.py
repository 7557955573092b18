"""WindowMLP: a next-token MLP that sees the previous `context` tokens.

Each position t embeds tokens t-context+1..t (a learned pad token stands in before
the start of the sequence), concatenates the embeddings and runs `n_layer` GELU
hidden layers of width `n_embd`, then a linear layer to vocabulary logits. Position
t never sees a token after t, so the model is causal like GPT and trains on the
same (inputs, targets) batches.
"""

from __future__ import annotations

from itertools import pairwise

import torch
import torch.nn.functional as F
from torch import nn

from trainstack.config import ModelConfig


class WindowMLP(nn.Module):
    """Windowed next-token MLP: `forward(idx[B, T]) -> logits[B, T, vocab_size]`."""

    def __init__(self, cfg: ModelConfig, *, vocab_size: int) -> None:
        super().__init__()
        assert cfg.n_layer >= 1 and cfg.context >= 1
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.pad_token = vocab_size  # one extra embedding row, used left of the start
        self.tok_emb = nn.Embedding(vocab_size + 1, cfg.n_embd)
        widths = [cfg.context * cfg.n_embd] + [cfg.n_embd] * cfg.n_layer
        self.hidden = nn.ModuleList(nn.Linear(i, o) for i, o in pairwise(widths))
        self.drop = nn.Dropout(cfg.dropout)
        self.lm_head = nn.Linear(cfg.n_embd, vocab_size)

        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        c = self.cfg.context
        padded = F.pad(idx, (c - 1, 0), value=self.pad_token)  # [B, T + c - 1]
        windows = padded.unfold(1, c, 1)  # [B, T, c]: tokens t-c+1..t
        x = self.tok_emb(windows).reshape(B, T, c * self.cfg.n_embd)
        for layer in self.hidden:
            x = self.drop(F.gelu(layer(x)))
        return self.lm_head(x)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    @staticmethod
    def count_parameters(cfg: ModelConfig, *, vocab_size: int) -> tuple[int, int]:
        """(parameters, parameter tensors) of `WindowMLP(cfg, vocab_size)`, without
        building it: the embedding (with its pad row), each hidden layer's weight and
        bias, and the head's."""
        d = cfg.n_embd
        hidden = (cfg.context * d * d + d) + (cfg.n_layer - 1) * (d * d + d)
        numel = (vocab_size + 1) * d + hidden + d * vocab_size + vocab_size
        return numel, 1 + 2 * cfg.n_layer + 2

    def flops_per_token(self) -> int:
        """Training FLOPs per token, forward + backward: `6 * N_matmul`.

        N_matmul counts the weight matrices of the linear layers, the only weights
        that take part in matmuls: `context*d*d + (n_layer-1)*d*d + d*vocab` for
        d = n_embd. Embedding lookups, biases and GELU are left out (they are
        O(d) per token against O(d^2)).
        """
        layers = [*self.hidden, self.lm_head]
        n_matmul = sum(layer.weight.numel() for layer in layers)
        return 6 * n_matmul
