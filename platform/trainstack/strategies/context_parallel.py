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
attention over the whole sequence. It is one autograd function (`_RingAttention`) that
keeps what a fused attention kernel keeps (q, this rank's k and v, the output and the
log-sum-exp, never a block's scores), so a rank's activations are those of a T / N
sequence; its backward makes each block's scores again and passes the keys and values
round once more, their gradients travelling with them back to the rank that holds them.

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

from trainstack.data.sharding import IGNORED_TARGET, Batch
from trainstack.dims import ParallelDims
from trainstack.models.sequence_shard import (
    SequenceShard,
    current_documents,
    current_shard,
    document_ids,
    sequence_shard,
)


def zigzag_positions(seq_len: int, *, size: int, rank: int) -> torch.Tensor:
    """The positions rank `rank` of `size` holds: chunks `rank` and `2 size - 1 - rank` of
    2 size equal chunks (`seq_len` divisible by 2 size)."""
    chunk = seq_len // (2 * size)
    early = torch.arange(rank * chunk, (rank + 1) * chunk)
    late = torch.arange((2 * size - 1 - rank) * chunk, (2 * size - rank) * chunk)
    return torch.cat([early, late])


class Ring:
    """This rank's context-parallel group as a ring: global ranks of its neighbours."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.previous = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def pass_on(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """Each tensor sent to the next rank; the previous rank's received in its place."""
        sent = [t.contiguous() for t in tensors]
        received = [torch.empty_like(t) for t in sent]
        requests = []
        for out, into in zip(sent, received, strict=True):  # in order: gloo and NCCL match
            requests.append(dist.isend(out, dst=self.next, group=self.group))  # by order
            requests.append(dist.irecv(into, src=self.previous, group=self.group))
        for request in requests:
            assert request is not None, "this rank is in the ring's group"
            request.wait()
        return received


def _block_scores(
    q: torch.Tensor, k: torch.Tensor, visible: torch.Tensor, scale: float
) -> torch.Tensor:
    """Scaled scores of queries over one block of keys, -inf where a key is not seen."""
    return ((q @ k.transpose(-2, -1)) * scale).masked_fill(~visible, float("-inf"))


def _probabilities(scores: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """softmax weights of one block's scores, given the whole row's log-sum-exp."""
    return torch.exp(scores - lse)  # a masked score: exp(-inf) = 0


def _visible(
    causal: torch.Tensor, q_documents: torch.Tensor | None, k_documents: torch.Tensor | None
) -> torch.Tensor:
    """Which keys each query sees: at or before it ([Tq, Tk]), and in packed rows within
    its own document ([B, 1, Tq, Tk])."""
    if q_documents is None or k_documents is None:
        return causal
    same = q_documents[:, None, :, None] == k_documents[:, None, None, :]
    return same & causal


class _RingAttention(torch.autograd.Function):
    """Forward: each block's scores, made and dropped in turn, merged by log-sum-exp;
    keeps only q, this rank's k and v, the output and the log-sum-exp (what a fused
    attention kernel keeps), so a rank's activations are 1/N of one process's. Backward:
    the blocks again, the keys and values passed round the ring once more with their
    gradients accumulating beside them, back to the rank that holds them. Packed rows'
    document ids travel round with the keys."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        documents: torch.Tensor | None,
        ring: Ring,
        causal: list[torch.Tensor],
        scale: float,
    ) -> torch.Tensor:
        out = torch.zeros_like(q)
        lse = torch.full((*q.shape[:-1], 1), float("-inf"), dtype=q.dtype, device=q.device)
        k_j, v_j, d_j = k, v, documents
        for step in range(ring.size):
            if step:
                k_j, v_j, d_j = _pass_on(ring, k_j, v_j, d_j)
            if not bool(causal[step].any()):
                continue
            scores = _block_scores(q, k_j, _visible(causal[step], documents, d_j), scale)
            block_lse = torch.logsumexp(scores, dim=-1, keepdim=True)  # -inf: row sees none
            merged = torch.logaddexp(lse, block_lse)
            finite = torch.isfinite(merged)
            safe = torch.where(finite, merged, torch.zeros_like(merged))
            out = out * torch.exp(lse - safe) + _probabilities(scores, safe) @ v_j
            lse = torch.where(finite, merged, lse)
        ctx.save_for_backward(q, k, v, out, lse, documents)
        ctx.ring, ctx.causal, ctx.scale = ring, causal, scale
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, documents = ctx.saved_tensors
        ring: Ring = ctx.ring
        scale: float = ctx.scale
        grad = grad.contiguous()
        delta = (grad * out).sum(dim=-1, keepdim=True)  # rowsum(dO ∘ O)
        dq = torch.zeros_like(q)
        k_j, v_j, d_j = k, v, documents
        dk_j, dv_j = torch.zeros_like(k), torch.zeros_like(v)
        for step in range(ring.size):
            if step:
                k_j, v_j, d_j, dk_j, dv_j = _pass_on(ring, k_j, v_j, d_j, dk_j, dv_j)
            if not bool(ctx.causal[step].any()):
                continue
            visible = _visible(ctx.causal[step], documents, d_j)
            p = _probabilities(_block_scores(q, k_j, visible, scale), lse)
            dv_j = dv_j + p.transpose(-2, -1) @ grad
            ds = p * (grad @ v_j.transpose(-2, -1) - delta)
            dq = dq + (ds @ k_j) * scale
            dk_j = dk_j + (ds.transpose(-2, -1) @ q) * scale
        if ring.size > 1:  # the gradients of the keys and values held one rank back
            dk_j, dv_j = ring.pass_on(dk_j, dv_j)
        return dq, dk_j, dv_j, None, None, None, None


def _pass_on(ring: Ring, *tensors: torch.Tensor | None) -> list[Any]:
    """`Ring.pass_on` of the tensors given (None stays None: rows that are not packed)."""
    sent = [t for t in tensors if t is not None]
    received = iter(ring.pass_on(*sent))
    return [next(received) if t is not None else None for t in tensors]


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    ring: Ring,
    positions: list[torch.Tensor],
    documents: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal softmax attention of this rank's queries [B, H, Tq, D] over the keys and
    values of every rank of `ring` (each [B, H, Tk, D], `positions[i]` the global places of
    ring rank i's tokens); packed rows keep each query to its own document (`documents`
    [B, Tq], this rank's tokens' document ids); `scale`: the scores' (1/sqrt(D) if None)."""
    q_pos = positions[ring.rank]
    causal = [
        positions[(ring.rank - step) % ring.size][None, :] <= q_pos[:, None]
        for step in range(ring.size)
    ]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out: torch.Tensor = _RingAttention.apply(q, k, v, documents, ring, causal, scale)
    return out


class ContextParallel:
    """This rank's share of each row (`local`) and the shard the model runs under (`shard`)."""

    def __init__(
        self, group: dist.ProcessGroup, *, seq_len: int, positions_in_inputs: bool = False
    ) -> None:
        self.ring = Ring(group)
        self.positions_in_inputs = positions_in_inputs
        """A Hugging Face model takes its tokens' positions with them (its rotary angles):
        unpacked rows become [B, 3, T/N] too, positions 0..T-1 and one document."""
        self.positions = [
            zigzag_positions(seq_len, size=self.ring.size, rank=r) for r in range(self.ring.size)
        ]

    def local(self, batch: Batch) -> Batch:
        """The batch's columns this rank holds (inputs and targets [B, T] -> [B, 2T/2N]).
        Packed rows' inputs [B, 2, T] (token and position ids) come with a third row, each
        token's document id in its whole row ([B, 3, 2T/2N]), for the ring's masks."""
        mine = self.positions[self.ring.rank]
        x, y = batch
        if x.ndim == 2 and self.positions_in_inputs:
            x = torch.stack([x, torch.arange(x.shape[1], device=x.device).expand_as(x)], dim=1)
        if x.ndim == 3:
            x = torch.cat([x, document_ids(x[:, 1])[:, None]], dim=1)
        return x.index_select(-1, mine.to(x.device)), y.index_select(1, mine.to(y.device))

    def local_with_share(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, float]:
        """`local(batch)`, and what this rank's mean loss is weighted by so that FSDP's
        average over the group's ranks is the micro-batch's mean over its scored tokens:
        N × this rank's scored targets / the whole row's (1 where every target is scored;
        a packed chat row's unscored prompts fall unevenly on the ranks)."""
        x, y = self.local(batch)
        scored = int((batch[1] != IGNORED_TARGET).sum())
        mine = int((y != IGNORED_TARGET).sum())
        return x, y, self.ring.size * mine / scored if scored else 0.0

    @contextlib.contextmanager
    def shard(self, device: torch.device) -> Iterator[None]:
        """The model computes this rank's share of the sequence inside."""
        positions = [p.to(device) for p in self.positions]

        def attend(
            q: torch.Tensor,
            k: torch.Tensor,
            v: torch.Tensor,
            documents: torch.Tensor | None,
            scale: float | None,
        ) -> torch.Tensor:
            return ring_attention(
                q, k, v, ring=self.ring, positions=positions, documents=documents, scale=scale
            )

        with sequence_shard(SequenceShard(positions=positions[self.ring.rank], attend=attend)):
            yield


def context_parallel_groups(dims: ParallelDims) -> dist.ProcessGroup:
    """This rank's context-parallel group: the ranks that differ in their cp coordinate
    alone (with tensor parallelism, the same tp rank of each). A collective: every rank
    creates every group, in the same order."""
    groups = [
        [dims.rank(pp=pp, dp=dp, cp=cp, tp=tp) for cp in range(dims.cp)]
        for pp in range(dims.pp)
        for dp in range(dims.dp)
        for tp in range(dims.tp)
    ]
    group, _ = dist.new_subgroups_by_enumeration(groups)
    assert group is not None, "every rank is in one group"
    return group


RING_ATTENTION = "trainstack_ring"
"""The name a Hugging Face model's attention takes under context parallelism."""


def use_ring_attention(model: Any) -> None:
    """Make a Hugging Face model's attention layers call the ring (transformers'
    `AttentionInterface`, registered once under `RING_ATTENTION`)."""
    from transformers import AttentionInterface

    AttentionInterface.register(RING_ATTENTION, _hf_ring_attention)
    model.set_attn_implementation(RING_ATTENTION)


def _hf_ring_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention function under context parallelism: the shard's ring
    (its keys and values repeated to the queries' heads first, as transformers' `repeat_kv`
    does), with the model's own scaling; the mask transformers built for this rank's
    tokens alone is not used. Returns [B, T, heads, head_dim], as transformers' do."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    shard = current_shard()
    if shard is None:  # outside a shard (a probe forward): plain attention
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    repeats = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(repeats, dim=1), value.repeat_interleave(repeats, dim=1)
    out = shard.attend(query, key, value, current_documents(), scaling)
    return out.transpose(1, 2).contiguous(), None
