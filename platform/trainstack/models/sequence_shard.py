"""A model's share of a sequence under context parallelism (`strategy.context_parallel`):
while a `SequenceShard` is current, trainstack's GPT embeds its tokens at their global
`positions` (not 0..T_local-1) and its attention runs `attend` (the strategy's ring over
the context-parallel group) in place of attention over the local tokens alone.

The shard stays current over the forward and the backward of a micro-batch, so blocks
that recompute their activations in the backward (activation checkpointing) see it too.
Which tokens a rank holds, and the ring itself, are the strategy's
(`strategies/context_parallel.py`); the model only asks here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class SequenceShard:
    positions: torch.Tensor
    """This rank's tokens' places in the whole sequence, int64 [T_local]."""
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    """Causal attention of this rank's queries over the whole sequence's keys and values:
    (q, k, v) [B, heads, T_local, head_dim] -> [B, heads, T_local, head_dim]."""


_CURRENT: ContextVar[SequenceShard | None] = ContextVar("trainstack_sequence_shard", default=None)


@contextlib.contextmanager
def sequence_shard(shard: SequenceShard) -> Iterator[None]:
    """Inside, `current_shard()` is `shard`."""
    token = _CURRENT.set(shard)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current_shard() -> SequenceShard | None:
    """The sequence shard of the forward (or backward) running here, if any."""
    return _CURRENT.get()
