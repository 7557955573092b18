"""A model's share of a sequence under context parallelism (`strategy.context_parallel`):
while a `SequenceShard` is current, trainstack's GPT embeds its tokens at their global
`positions` (not 0..T_local-1) and its attention runs `attend` (the strategy's ring over
the context-parallel group) in place of attention over the local tokens alone.

The shard stays current over the forward and the backward of a micro-batch, so blocks
that recompute their activations in the backward (activation checkpointing) see it too.
Which tokens a rank holds, and the ring itself, are the strategy's
(`strategies/context_parallel.py`); the model only asks here.

Packed rows (`data.pack`: inputs [B, 2, T] of token ids and position ids restarting at
each document) number their documents (`document_ids`), and attention keeps each token
to its own document while `packed_documents` is current: the GPT's forward sets it.
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
    attend: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, float | None],
        torch.Tensor,
    ]
    """Causal attention of this rank's queries over the whole sequence's keys and values:
    (q, k, v [B, heads, T_local, head_dim], this rank's tokens' document ids [B, T_local]
    in packed rows or None, the scores' scale or None for 1/sqrt(head_dim)) -> [B, heads,
    T_local, head_dim]."""


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


_DOCUMENTS: ContextVar[torch.Tensor | None] = ContextVar("trainstack_documents", default=None)


@contextlib.contextmanager
def packed_documents(ids: torch.Tensor) -> Iterator[None]:
    """Inside, attention keeps each token to the tokens of its own document: `ids` [B, T]
    (this rank's tokens) numbers the documents of each packed row."""
    token = _DOCUMENTS.set(ids)
    try:
        yield
    finally:
        _DOCUMENTS.reset(token)


def current_documents() -> torch.Tensor | None:
    """The document ids of the packed rows being computed here, if any."""
    return _DOCUMENTS.get()


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """Packed rows' document numbers [B, T] from their position ids, which restart at 0
    at each document (and at the padding): a running count of the restarts."""
    return torch.cumsum(positions == 0, dim=-1)
