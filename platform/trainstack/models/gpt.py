"""GPT: a decoder-only transformer in the style of nanoGPT.

Token + learned position embedding, `n_layer` pre-LayerNorm blocks (causal
self-attention, 4x GELU MLP), a final LayerNorm and an LM head tied to the token
embedding. The forward pass is `pipeline_layers()` applied in order: the embedding
(`GPTEmbedding`), each block, then the head (`GPTHead`); a pipeline cuts the model
along the same layers, so there is one GPT forward. The layers hold the model's own
submodules (`tok_emb`, `pos_emb`, `blocks`, `ln_f`, `lm_head`), so parameter names
are the model's wherever a layer runs.

Under context parallelism (`models/sequence_shard.py`) a rank's embedding and attention
see its share of the sequence: its tokens' global positions, and attention over the
whole sequence's keys by the strategy's ring.

With `model.moe.experts` E > 0, every `moe.every`-th block's MLP is a mixture of E
experts (`models/moe.py`), and the forward returns `MoEOutput(logits, aux_loss)`: the
logits and the blocks' weighted balance loss, which the task adds to the training loss.
"""

from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from trainstack.config import ModelConfig
from trainstack.models.linear_ce import LMHead
from trainstack.models.moe import MoE, MoEOutput, total_aux_loss
from trainstack.models.sequence_shard import (
    current_documents,
    current_shard,
    document_ids,
    packed_documents,
)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with one projection each for queries, keys and
    values, so a tensor-parallel rank can hold whole heads of each (column-parallel
    `q_proj`/`k_proj`/`v_proj`, row-parallel `c_proj`): the head count is read from the
    projections' output, which holds this rank's heads only."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0, "n_head must divide n_embd"
        self.head_dim = cfg.n_embd // cfg.n_head
        self.dropout = cfg.dropout
        # No qkv bias: softmax ignores a key bias, so its true gradient is zero and Adam
        # would turn round-off noise in it into full-size updates.
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.k_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.v_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # (B, T, heads * head_dim) -> (B, heads, T, head_dim)
        q, k, v = (
            proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        shard, documents = current_shard(), current_documents()
        dropout_p = self.dropout if self.training else 0.0
        if shard is not None:  # context parallel: this rank's queries over every key
            y = shard.attend(q, k, v, documents, None)
        elif documents is not None:  # packed rows: each token within its own document
            same = documents[:, None, :, None] == documents[:, None, None, :]
            mask = same & torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
        else:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)
        return self.resid_drop(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x)); the MLP is a
    mixture of experts when `moe`."""

    def __init__(self, cfg: ModelConfig, *, moe: bool = False) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp: nn.Module = moe_layer(cfg) if moe else MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPTEmbedding(nn.Module):
    """Token + position embedding, then dropout: token ids [B, T] -> [B, T, C]."""

    def __init__(self, *, tok_emb: nn.Embedding, pos_emb: nn.Embedding, drop: nn.Dropout) -> None:
        super().__init__()
        self.tok_emb, self.pos_emb, self.drop = tok_emb, pos_emb, drop

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.ndim == 3:  # packed rows: token ids, then each token's place in its document
            idx, pos = idx[:, 0], idx[:, 1]
            return self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        seq_len = idx.shape[1]
        assert seq_len <= self.pos_emb.num_embeddings, f"{seq_len} tokens > block_size"
        shard = current_shard()  # context parallel: this rank's tokens' own positions
        pos = shard.positions if shard is not None else torch.arange(seq_len, device=idx.device)
        return self.drop(self.tok_emb(idx) + self.pos_emb(pos))


class GPTHead(nn.Module):
    """Final LayerNorm and LM head: [B, T, C] -> logits [B, T, V], or given the targets
    [B, T], their mean cross-entropy computed without the logits (`model.fused_loss`)."""

    def __init__(self, *, ln_f: nn.LayerNorm, lm_head: LMHead) -> None:
        super().__init__()
        self.ln_f, self.lm_head = ln_f, lm_head

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        out: torch.Tensor = self.lm_head(self.ln_f(x), targets)
        return out


class LMLoss(NamedTuple):
    """What the GPT returns given the targets: the cross-entropy, and the MoE aux loss."""

    loss: torch.Tensor
    aux_loss: torch.Tensor | None


class GPT(nn.Module):
    """Decoder-only transformer: `forward(idx[B, T]) -> logits[B, T, vocab_size]`."""

    def __init__(self, cfg: ModelConfig, *, vocab_size: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.tok_emb = nn.Embedding(vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(
            Block(cfg, moe=is_moe_block(cfg, i)) for i in range(cfg.n_layer)
        )
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = LMHead(cfg.n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # tied: one tensor, counted once

        self.apply(_init_weights)
        # Residual projections: std 0.02 / sqrt(2 * n_layer) (GPT-2 paper).
        for name, p in self.named_parameters():
            if name.endswith(("c_proj.weight", "mlp.w_out")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    def pipeline_layers(self) -> list[nn.Module]:
        """The model as layers applied in order: embedding, each block, head."""
        embedding = GPTEmbedding(tok_emb=self.tok_emb, pos_emb=self.pos_emb, drop=self.drop)
        return [embedding, *self.blocks, GPTHead(ln_f=self.ln_f, lm_head=self.lm_head)]

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> torch.Tensor | MoEOutput | LMLoss:
        """Logits `[B, T, V]` (with the MoE blocks' aux loss: `MoEOutput`); given the
        targets, the loss itself (`LMLoss`), the logits never made whole. `idx` is token
        ids [B, T], or packed rows [B, 2, T] (token ids and position ids restarting at
        each document: each token attends within its document), under context
        parallelism [B, 3, T_local] with the rows' document ids third."""
        *layers, head = self.pipeline_layers()
        x = idx
        with contextlib.ExitStack() as stack:
            if idx.ndim == 3:  # packed rows [B, 2 or 3, T]: the third row, documents' ids
                ids = idx[:, 2] if idx.shape[1] > 2 else document_ids(idx[:, 1])
                stack.enter_context(packed_documents(ids))
            for layer in layers:
                x = layer(x)
        out = head(x, targets)
        aux = total_aux_loss(self) if self.cfg.moe.experts else None
        if targets is not None:
            return LMLoss(loss=out, aux_loss=aux)
        return out if aux is None else MoEOutput(logits=out, aux_loss=aux)

    def num_params(self) -> int:
        """Parameters, each tensor counted once (the tied head is the token embedding)."""
        return sum(p.numel() for p in self.parameters())

    @staticmethod
    def count_parameters(cfg: ModelConfig, *, vocab_size: int) -> tuple[int, int]:
        """(parameters, parameter tensors) of `GPT(cfg, vocab_size)`, without building it.

        Embeddings (the head is tied to the token embedding) V*d + T*d, each block
        12*d*d + 10*d (ln_1, q/k/v projections without bias, c_proj, ln_2, c_fc, c_proj)
        in 13 tensors, and ln_f 2*d in 2. An MoE block's MLP (8*d*d + 5*d in 4 tensors)
        is a router E*d and E experts 2*d*h instead, in 3 tensors.
        """
        d = cfg.n_embd
        numel = (vocab_size + cfg.block_size) * d + cfg.n_layer * (12 * d * d + 10 * d) + 2 * d
        tensors = 2 + 13 * cfg.n_layer + 2
        blocks = moe_blocks(cfg)
        if blocks:
            e, h = cfg.moe.experts, expert_hidden(cfg)
            numel += blocks * (e * d + 2 * e * d * h - (8 * d * d + 5 * d))
            tensors -= blocks
        return numel, tensors

    def flops_per_token(self) -> int:
        """Training FLOPs per token, forward + backward (PaLM appendix B, as in nanoGPT).

        `6 * N + 12 * n_layer * n_embd * block_size`, where N is the parameter count
        without the position embedding (a lookup, no matmul): 6N for the weight matmuls
        (2 forward, 4 backward) and the second term for attention scores and values.
        An MoE block counts the experts a token is routed to (top_k of them), not all.
        """
        n = self.num_params() - self.pos_emb.weight.numel()
        for block in self.blocks:
            if isinstance(block.mlp, MoE):
                idle = block.mlp.num_experts - block.mlp.top_k
                n -= idle * (block.mlp.w_in[0].numel() + block.mlp.w_out[0].numel())
        attn = 12 * self.cfg.n_layer * self.cfg.n_embd * self.cfg.block_size
        return 6 * n + attn


def is_moe_block(cfg: ModelConfig, index: int) -> bool:
    """Whether block `index` has MoE experts: the last of each run of `moe.every` blocks."""
    return cfg.moe.experts > 0 and index % cfg.moe.every == cfg.moe.every - 1


def moe_blocks(cfg: ModelConfig) -> int:
    """How many of the GPT's blocks have MoE experts."""
    return sum(is_moe_block(cfg, i) for i in range(cfg.n_layer))


def expert_hidden(cfg: ModelConfig) -> int:
    """Each expert's hidden width: `moe.expert_hidden`, else the dense MLP's 4 × n_embd."""
    return cfg.moe.expert_hidden or 4 * cfg.n_embd


def moe_layer(cfg: ModelConfig) -> MoE:
    m = cfg.moe
    return MoE(
        cfg.n_embd,
        experts=m.experts,
        top_k=m.top_k,
        hidden=expert_hidden(cfg),
        capacity_factor=m.capacity_factor,
        balance=m.balance,
        aux_weight=m.aux_weight,
        bias_rate=m.bias_rate,
    )


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
