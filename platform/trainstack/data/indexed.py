"""One global sample stream over a finite data set, read in seeded epochs.

A finite source (token files, arrays, your Dataset) is a `SampleSet`: N samples
addressed by id 0..N-1. Global stream index g is epoch e = g // N at position
p = g % N, and reads sample `order_e[p]`, where `order_e` is a permutation seeded by
(data.seed, e) (the identity with `data.shuffle: false`). So every epoch covers every
sample once, each epoch is shuffled differently, and the sample at g depends on g
alone: sharding by `sharding.ShardedBatches` gives the same global batch at any world
size, and a cursor of samples seen resumes exactly (bitwise at the same layout).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from trainstack.data.sharding import Batch


class SampleSet(Protocol):
    """N samples addressed by id; `take` returns them as one (inputs, targets) batch."""

    def __len__(self) -> int: ...

    def take(self, ids: np.ndarray, *, seq_len: int) -> Batch:
        """Samples `ids` (int64, in this order) as (inputs, targets)."""
        ...


@dataclass(kw_only=True)
class EpochOrder:
    """The order samples are read in: a seeded permutation of 0..size-1 per epoch."""

    size: int
    seed: int
    shuffle: bool = True
    _cache: dict[int, np.ndarray] = field(default_factory=dict, repr=False)

    def ids(self, start: int, count: int) -> np.ndarray:
        """Sample ids of global stream indices start..start+count-1."""
        g = np.arange(start, start + count, dtype=np.int64)
        epochs, positions = np.divmod(g, self.size)
        out = np.empty(count, dtype=np.int64)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            out[mask] = self.order(int(epoch))[positions[mask]]
        return out

    def order(self, epoch: int) -> np.ndarray:
        """Epoch `epoch`'s permutation (two kept: a batch may straddle an epoch's end)."""
        if epoch not in self._cache:
            if self.shuffle:
                rng = np.random.default_rng([self.seed, epoch])
                order = rng.permutation(self.size).astype(np.int64)
            else:
                order = np.arange(self.size, dtype=np.int64)
            self._cache = {e: o for e, o in self._cache.items() if e == epoch - 1}
            self._cache[epoch] = order
        return self._cache[epoch]

    def epoch(self, samples_seen: int) -> int:
        """The epoch the next sample after `samples_seen` belongs to."""
        return samples_seen // self.size


@dataclass(kw_only=True)
class IndexedCorpus:
    """A `sharding.Corpus` over finite training and held-out sample sets."""

    train: SampleSet
    held_out: SampleSet | None
    order: EpochOrder
    fingerprint: str
    """Digest of the data (file sizes and hashes, or the source's parameters)."""

    def train_batch(self, start: int, count: int, *, seq_len: int) -> Batch:
        return self.train.take(self.order.ids(start, count), seq_len=seq_len)

    def held_out_batch(self, count: int, *, seq_len: int) -> Batch:
        assert self.held_out is not None and count <= len(self.held_out), (
            "pre-flight bounds data.eval_samples by the held-out samples"
        )
        return self.held_out.take(np.arange(count, dtype=np.int64), seq_len=seq_len)

    def loss_floor(self, seq_len: int) -> float | None:
        """Unknown for real data."""
        return None

    def epoch(self, samples_seen: int, *, seq_len: int) -> int:
        return self.order.epoch(samples_seen)


class ByLength:
    """A `sharding.Corpus` whose samples depend on the sequence length (file sources that
    cut or pad to it): one `IndexedCorpus` per length, which `at` builds on first use."""

    def at(self, seq_len: int) -> IndexedCorpus:
        raise NotImplementedError

    def train_batch(self, start: int, count: int, *, seq_len: int) -> Batch:
        return self.at(seq_len).train_batch(start, count, seq_len=seq_len)

    def held_out_batch(self, count: int, *, seq_len: int) -> Batch:
        return self.at(seq_len).held_out_batch(count, seq_len=seq_len)

    def loss_floor(self, seq_len: int) -> float | None:
        """Unknown for real data."""
        return None

    def epoch(self, samples_seen: int, *, seq_len: int) -> int:
        """The epoch the next sample after `samples_seen` belongs to, at this length."""
        return self.at(seq_len).epoch(samples_seen, seq_len=seq_len)
