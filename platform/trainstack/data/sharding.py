"""Deterministic rank sharding of an indexed sample stream, with a resumable cursor.

The global stream is samples 0, 1, 2, ... of a corpus. Optimizer step s takes the
global batch [g0, g0 + G) with g0 = cursor.samples_seen. With N ranks, micro-batch
size b and A = G / (b * N) accumulation micro-steps, micro-step a of rank r is

    [g0 + a*N*b + r*b, g0 + a*N*b + (r+1)*b)

so the union over ranks and micro-steps is exactly [g0, g0 + G): the same global
batch a 1-worker run sees. The cursor counts samples of the global stream, so a run
resumed with a different number of workers continues without skipping or repeating.
The corpus turns an index range into a `Batch` itself (next-token pairs for `lm`,
inputs and labels for `classify`), so this file is the same for every task.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from trainstack.config import JobConfig

Batch = tuple[torch.Tensor, torch.Tensor]
"""(inputs, targets) of one micro-batch, rows in global-index order: token ids
int64 [b, seq_len] and the next tokens (markov), or inputs float32 [b, *shape] and
labels int64 [b] (clusters). Packed chat rows (`data.pack`) have inputs int64
[b, 2, seq_len]: token ids and position ids (`data/chat.py`)."""

IGNORED_TARGET = -100
"""A target no loss scores (torch's cross-entropy `ignore_index`): a chat sample's
prompts and padding. Held-out sums do not count it."""


class Corpus(Protocol):
    """A sample stream addressed by a global index, with a disjoint held-out set."""

    def train_batch(self, start: int, count: int, *, seq_len: int) -> Batch:
        """Training samples start..start+count-1 as (inputs, targets); row i depends on
        the corpus and the index start + i alone."""
        ...

    def held_out_batch(self, count: int, *, seq_len: int) -> Batch:
        """The first `count` held-out samples as (inputs, targets), disjoint from every
        training index; a larger count extends the same rows."""
        ...

    @property
    def fingerprint(self) -> str:
        """Digest of the data (files' sizes and hashes, or a synthetic source's parameters)."""
        ...

    def epoch(self, samples_seen: int, *, seq_len: int) -> int:
        """The epoch sample `samples_seen` of the stream belongs to."""
        ...

    def loss_floor(self, seq_len: int) -> float | None:
        """The lowest mean held-out cross-entropy a model can reach (sequence sources:
        on seq_len targets; others ignore seq_len); None where unknown (real data)."""
        ...


@dataclass(kw_only=True)
class DataCursor:
    samples_seen: int = 0
    """Samples of the global stream consumed so far, all ranks together."""

    def state_dict(self) -> dict[str, int]:
        return {"samples_seen": self.samples_seen}

    @classmethod
    def from_state_dict(cls, state: Mapping[str, int]) -> DataCursor:
        return cls(samples_seen=int(state["samples_seen"]))


@dataclass(kw_only=True)
class ShardedBatches:
    """One rank's micro-batches of each optimizer step; advances the shared cursor."""

    corpus: Corpus
    seq_len: int
    global_batch_size: int
    micro_batch_size: int
    rank: int
    world_size: int
    cursor: DataCursor = field(default_factory=DataCursor)

    def __post_init__(self) -> None:
        per_micro_step = self.micro_batch_size * self.world_size
        if self.global_batch_size % per_micro_step != 0:
            raise ValueError(
                f"global batch {self.global_batch_size} is not a multiple of "
                f"micro_batch_size * world_size = {per_micro_step}"
            )
        assert 0 <= self.rank < self.world_size

    @classmethod
    def for_job(
        cls, cfg: JobConfig, corpus: Corpus, *, rank: int, world_size: int, samples_seen: int = 0
    ) -> ShardedBatches:
        """Replica `rank` of `world_size`'s batches of `corpus` at the job's sequence length
        and batch sizes, from sample `samples_seen` of the global stream."""
        return cls(
            corpus=corpus,
            seq_len=cfg.model.block_size,
            global_batch_size=cfg.train.global_batch_size,
            micro_batch_size=cfg.train.micro_batch_size,
            rank=rank,
            world_size=world_size,
            cursor=DataCursor(samples_seen=samples_seen),
        )

    @property
    def accum_steps(self) -> int:
        """Micro-steps per optimizer step on this rank."""
        return self.global_batch_size // (self.micro_batch_size * self.world_size)

    def next_step(self) -> list[Batch]:
        """This rank's micro-batches for the next optimizer step, in accumulation order."""
        g0, b, n = self.cursor.samples_seen, self.micro_batch_size, self.world_size
        batches = []
        for a in range(self.accum_steps):
            start = g0 + a * n * b + self.rank * b
            batches.append(self.corpus.train_batch(start, b, seq_len=self.seq_len))
        self.cursor.samples_seen += self.global_batch_size
        return batches


def eval_batches(
    corpus: Corpus, *, count: int, seq_len: int, micro_batch_size: int, rank: int, world_size: int
) -> list[Batch]:
    """This rank's share of the first `count` held-out samples, as micro-batches.

    Rank r takes the contiguous slice [r*count//N, (r+1)*count//N); the slices of all
    ranks cover the set exactly once. Shares differ by at most one sample, the last
    micro-batch may be short, and a rank with no share gets an empty list: weight
    each batch's mean loss by its row count when averaging over ranks. A sample of
    several rows (a preference pair's two) keeps them together.
    """
    lo, hi = rank * count // world_size, (rank + 1) * count // world_size
    if hi == lo:
        return []
    inputs, targets = corpus.held_out_batch(hi, seq_len=seq_len)
    rows = len(inputs) // hi  # rows a sample takes: 2 for a preference pair, else 1
    mine = slice(lo * rows, None)
    xs = inputs[mine].split(micro_batch_size * rows)
    ys = targets[mine].split(micro_batch_size * rows)
    return list(zip(xs, ys, strict=True))
