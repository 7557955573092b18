"""Context parallelism (`strategy.context_parallel: N`, under fsdp): each of N ranks holds
1/N of every row's tokens, and attention runs as a ring over them.

**Which tokens.** The sequence of T positions is cut into 2N chunks of T / 2N; rank r of
the context-parallel group holds chunk r and chunk 2N - 1 - r (`zigzag_positions`). The
causal mask makes a later chunk's queries costlier (they see more keys), so each rank
gets one early and one late chunk: every rank does the same work. Inputs and targets
are cut the same way (`ContextParallel.local`); the model embeds its tokens at their
global positions (`models/sequence_shard.py`).

**Attention by ring** (`ring_attention`). Each rank computes its queries against its own
keys and values, then passes them on to the next rank of the ring and receives the
previous rank's, N - 1 times, so it sees every chunk once. Each block's scores are
masked by the chunks' global positions (a key is seen by the queries at or after it), a
block no query of this rank may see is skipped (its keys and values still pass on), and
the blocks are merged by their log-sum-exp (online softmax): the result equals softmax
attention over the whole sequence. The passing is an autograd function of its own
(`_PassOn`: forward to the next rank, its gradient back to the previous), so autograd
differentiates the whole ring and the backward returns each key's and value's gradient
to the rank that holds it. Each rank keeps its blocks' scores for the backward: [B, H,
T/N, T] over the N steps, 1/N of one process's.

**Why not torch's.** `torch.distributed.tensor.experimental.context_parallel` swaps
`scaled_dot_product_attention` for a ring over the flash, memory-efficient or cuDNN
kernels, which run on CUDA only (and not in float64): trainstack's equivalence tests run
on CPU in float64, and its users' CPU runs too. The ring here is plain tensor algebra
over point-to-point sends (gloo or NCCL), as exact as one process's math attention; it
is also slower than a fused kernel, so on a GPU torch's is the faster choice (not wired
yet).

**Gradients.** Each rank's loss is the mean over its tokens (N equal shares of every
row), and FSDP averages the gradients over every rank, data-parallel and
context-parallel alike (`ParallelDims`: FSDP shards over dp_shard × cp), which is the
mean over the whole batch's tokens: what one process computes.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from trainstack.data.sharding import Batch
from trainstack.models.sequence_shard import SequenceShard, sequence_shard


def zigzag_positions(seq_len: int, *, size: int, rank: int) -> torch.Tensor:
    """The positions rank `rank` of `size` holds: chunks `rank` and `2 size - 1 - rank` of
    2 size equal chunks (`seq_len` divisible by 2 size)."""
    chunk = seq_len // (2 * size)
    early = torch.arange(rank * chunk, (rank + 1) * chunk)
    late = torch.arange((2 * size - 1 - rank) * chunk, (2 * size - rank) * chunk)
    return torch.cat([early, late])


class _PassOn(torch.autograd.Function):
    """`x` sent to the next rank of the ring, the previous rank's received; backward,
    the gradient sent back to the previous rank and the next's received."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, ring: Ring) -> torch.Tensor:
        ctx.ring = ring
        return ring.exchange(x, to=ring.next, source=ring.previous)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ring: Ring = ctx.ring
        return ring.exchange(grad, to=ring.previous, source=ring.next), None


class Ring:
    """This rank's context-parallel group as a ring: global ranks of its neighbours."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.previous = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def exchange(self, x: torch.Tensor, *, to: int, source: int) -> torch.Tensor:
        x = x.contiguous()
        received = torch.empty_like(x)
        requests = [
            dist.isend(x, dst=to, group=self.group),
            dist.irecv(received, src=source, group=self.group),
        ]
        for request in requests:
            assert request is not None, "this rank is in the ring's group"
            request.wait()
        return received


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    ring: Ring,
    positions: list[torch.Tensor],
) -> torch.Tensor:
    """Causal softmax attention of this rank's queries [B, H, Tq, D] over the keys and
    values of every rank of `ring` (each [B, H, Tk, D], `positions[i]` the global places of
    ring rank i's tokens), merged block by block by log-sum-exp."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    q_pos = positions[ring.rank].to(q.device)
    out: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    for step in range(ring.size):
        if step:
            k, v = _PassOn.apply(k, ring), _PassOn.apply(v, ring)
        k_pos = positions[(ring.rank - step) % ring.size].to(q.device)
        visible = k_pos[None, :] <= q_pos[:, None]  # [Tq, Tk]
        if not bool(visible.any()):
            continue
        scores = (q @ k.transpose(-2, -1)) * scale
        scores = scores.masked_fill(~visible, float("-inf"))
        block_lse = torch.logsumexp(scores, dim=-1, keepdim=True)  # -inf: a row sees none
        seen = torch.isfinite(block_lse)
        weights = torch.exp(scores - torch.where(seen, block_lse, torch.zeros_like(block_lse)))
        block = weights @ v
        if out is None or lse is None:  # step 0: every query sees itself, so lse is finite
            out, lse = block, block_lse
            continue
        merged = torch.logaddexp(lse, block_lse)
        old_share = torch.exp(lse - merged)
        new_share = torch.where(seen, torch.exp(block_lse - merged), torch.zeros_like(merged))
        out, lse = out * old_share + block * new_share, merged
    assert out is not None, "a rank's queries see their own keys"
    return out


class ContextParallel:
    """This rank's share of each row (`local`) and the shard the model runs under (`shard`)."""

    def __init__(self, group: dist.ProcessGroup, *, seq_len: int) -> None:
        self.ring = Ring(group)
        self.seq_len = seq_len
        self.positions = [
            zigzag_positions(seq_len, size=self.ring.size, rank=r) for r in range(self.ring.size)
        ]

    def local(self, batch: Batch) -> Batch:
        """The batch's columns this rank holds (inputs and targets [B, T] -> [B, 2T/2N])."""
        mine = self.positions[self.ring.rank]
        x, y = batch
        return x.index_select(1, mine.to(x.device)), y.index_select(1, mine.to(y.device))

    @contextlib.contextmanager
    def shard(self, device: torch.device) -> Iterator[None]:
        """The model computes this rank's share of the sequence inside."""
        positions = [p.to(device) for p in self.positions]

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return ring_attention(q, k, v, ring=self.ring, positions=positions)

        with sequence_shard(SequenceShard(positions=positions[self.ring.rank], attend=attend)):
            yield


def context_parallel_groups(size: int) -> dist.ProcessGroup:
    """This rank's context-parallel group: `size` consecutive ranks (cp is the grid's
    innermost dimension under tp = 1). A collective: every rank creates every group."""
    group, _ = dist.new_subgroups(group_size=size)
    assert group is not None
    return group
