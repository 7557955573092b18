"""Cutting the GPT into pipeline stages, and where each stage runs.

The model is a chain of units: the embedding (token + position), `n_layer` blocks,
and the head (final LayerNorm + LM head). `split_stages` cuts it into S contiguous
stages, each holding at least one block, so that the largest stage has as few
parameters as possible (the embedding and the head count: the head's weight is the
tied token embedding, held again by the last stage). `StageModule` is one stage,
whose parameter names are the full model's, so stage state dicts merge back into the
model's.

Placement: with v stages per rank, `loop` puts stage s on rank s % p (GPipe, 1F1B,
the interleaved schedules) and `v` folds the chain back, rank r holding stages r and
2p-1-r (ZBV and DualPipeV), so the first and last stage share rank 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from trainstack.config import JobConfig
from trainstack.models.gpt import GPT


@dataclass(frozen=True, kw_only=True)
class PipelineGrid:
    """Where a rank sits among p pipeline ranks × d replicas (both engines):
    global rank = pp_rank × d + dp_rank."""

    pp_size: int
    dp_size: int
    pp_rank: int
    dp_rank: int

    @classmethod
    def of(cls, cfg: JobConfig, *, rank: int) -> PipelineGrid:
        pp_rank, dp_rank = divmod(rank, cfg.strategy.data_parallel)
        return cls(
            pp_size=cfg.strategy.stages,
            dp_size=cfg.strategy.data_parallel,
            pp_rank=pp_rank,
            dp_rank=dp_rank,
        )

    def global_rank(self, *, pp_rank: int) -> int:
        """The global rank of pipeline rank `pp_rank` in this rank's replica."""
        return pp_rank * self.dp_size + self.dp_rank


def last_stage_mean(value: torch.Tensor, *, holds_last: bool, replicas: int) -> float:
    """Mean over the replicas of a value only the last stage knows (the loss). A collective."""
    value = value.detach().to(torch.float64).clone()
    if not holds_last:
        value.zero_()
    dist.all_reduce(value)
    return float(value) / replicas


@dataclass(frozen=True, kw_only=True)
class StageSplit:
    """Which blocks each of the S stages holds (stage 0 also the embedding, stage S-1
    also the head) and its parameter count."""

    blocks: tuple[range, ...]
    params: tuple[int, ...]

    @property
    def num_stages(self) -> int:
        return len(self.blocks)

    def describe(self) -> str:
        parts = []
        for s, (blocks, params) in enumerate(zip(self.blocks, self.params, strict=True)):
            units = [f"blocks {blocks.start}-{blocks.stop - 1}"]
            if s == 0:
                units.insert(0, "embedding")
            if s == self.num_stages - 1:
                units.append("head")
            parts.append(f"stage {s}: {' + '.join(units)} ({params:,} params)")
        return "; ".join(parts)


def unit_params(model: GPT) -> tuple[int, list[int], int]:
    """Parameters of the embedding, of each block, and of the head (its tied weight counted)."""
    embed = model.tok_emb.weight.numel() + model.pos_emb.weight.numel()
    blocks = [sum(p.numel() for p in block.parameters()) for block in model.blocks]
    head = model.lm_head.weight.numel() + sum(p.numel() for p in model.ln_f.parameters())
    return embed, blocks, head


def split_stages(model: GPT, num_stages: int) -> StageSplit:
    """Contiguous stages of >= 1 block each, minimising the largest stage's parameters."""
    embed, blocks, head = unit_params(model)
    n = len(blocks)
    assert 1 <= num_stages <= n, (num_stages, n, "config validation bounds stages by n_layer")

    def cost(s: int, lo: int, hi: int) -> int:
        return sum(blocks[lo:hi]) + (embed if s == 0 else 0) + (head if s == num_stages - 1 else 0)

    # best[s][i]: the smallest possible largest stage when stages 0..s-1 hold blocks 0..i-1.
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for s in range(1, num_stages + 1):
        for i in range(s, n + 1):
            for j in range(s - 1, i):
                candidate = max(best[s - 1][j], cost(s - 1, j, i))
                if candidate < best[s][i]:
                    best[s][i], cut[s][i] = candidate, j
    bounds = [n]
    for s in range(num_stages, 0, -1):
        bounds.append(cut[s][bounds[-1]])
    bounds.reverse()
    ranges = tuple(range(bounds[s], bounds[s + 1]) for s in range(num_stages))
    params = tuple(cost(s, r.start, r.stop) for s, r in enumerate(ranges))
    return StageSplit(blocks=ranges, params=params)


def stage_ranks(*, pp_size: int, num_stages: int, style: str) -> list[int]:
    """The pipeline rank of each stage under `loop` or `v` placement."""
    if style == "loop":
        return [s % pp_size for s in range(num_stages)]
    assert style == "v" and num_stages == 2 * pp_size, (style, num_stages, pp_size)
    return [s if s < pp_size else 2 * pp_size - 1 - s for s in range(num_stages)]


class StageModule(nn.Module):
    """One pipeline stage of a GPT, sharing no tensors with it.

    Stage 0 maps token ids [B, T] to activations [B, T, C]; middle stages map
    activations to activations; the last stage maps them to logits [B, T, V].
    Parameter names are the full model's (`blocks.3.attn.c_attn.weight`).
    """

    def __init__(
        self,
        model: GPT,
        *,
        blocks: range,
        first: bool,
        last: bool,
        activation_checkpointing: bool = False,
    ) -> None:
        super().__init__()
        self.first, self.last = first, last
        self.activation_checkpointing = activation_checkpointing
        copy = _detached_copy
        if first:
            self.tok_emb = copy(model.tok_emb)
            self.pos_emb = copy(model.pos_emb)
            self.drop = copy(model.drop)
        self.blocks = nn.ModuleDict({str(i): copy(model.blocks[i]) for i in blocks})
        if last:
            self.ln_f = copy(model.ln_f)
            # Its own copy of the tied weight; the strategy keeps the two copies equal by
            # summing their gradients, as the tied model's backward does.
            self.lm_head = copy(model.lm_head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.drop(self.tok_emb(x) + self.pos_emb(pos))
        for block in self.blocks.values():
            if self.activation_checkpointing and self.training:
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        if self.last:
            x = self.lm_head(self.ln_f(x))
        return x


def _detached_copy(module: nn.Module) -> nn.Module:
    """A deep copy of `module` whose parameters share no storage with the original."""
    import copy

    clone = copy.deepcopy(module)
    for p in clone.parameters():
        p.data = p.data.clone()
    return clone
