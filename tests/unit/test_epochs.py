"""Epochs and sharding of a finite source, for any size and layout (hypothesis).

A stand-in `SampleSet` returns each sample's id as its data, so a run's batches are
the sequence of sample ids it trained on: the union over ranks is the global batch,
a run killed and resumed at another world size reads the same ids as one that never
stopped, and every epoch reads every sample exactly once.
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainstack.data.indexed import EpochOrder, IndexedCorpus
from trainstack.data.sharding import Batch, DataCursor, ShardedBatches


class SampleIds:
    """N samples whose inputs and targets are their own ids."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def take(self, ids: np.ndarray, *, seq_len: int) -> Batch:
        assert ((ids >= 0) & (ids < self.size)).all()
        t = torch.from_numpy(ids.copy())
        return t, t


def corpus(size: int, *, seed: int, shuffle: bool = True) -> IndexedCorpus:
    """A fresh corpus, as a new process (a resumed run) builds it."""
    order = EpochOrder(size=size, seed=seed, shuffle=shuffle)
    return IndexedCorpus(train=SampleIds(size), held_out=None, order=order, fingerprint="ids")


def step_ids(
    size: int, *, seed: int, world: int, micro: int, accum: int, steps: int, start_step: int = 0
) -> list[list[int]]:
    """Per optimizer step, the ids every rank read, in global-stream order (micro-step a
    of rank r holds stream positions a*world*micro + r*micro ...)."""
    global_batch = world * micro * accum
    ranks = [
        ShardedBatches(
            corpus=corpus(size, seed=seed),
            seq_len=1,
            global_batch_size=global_batch,
            micro_batch_size=micro,
            rank=rank,
            world_size=world,
            cursor=DataCursor(samples_seen=start_step * global_batch),
        )
        for rank in range(world)
    ]
    out = []
    for _ in range(steps):
        per_rank = [r.next_step() for r in ranks]
        out.append([int(i) for a in range(accum) for r in range(world) for i in per_rank[r][a][0]])
    return out


layouts = st.tuples(st.integers(1, 4), st.integers(1, 5), st.integers(1, 4))
"""(world size, micro-batch size, accumulation steps)."""


@settings(max_examples=60, deadline=None)
@given(size=st.integers(1, 60), seed=st.integers(0, 2**16), layout=layouts)
def test_each_steps_union_over_ranks_is_the_global_batch(
    size: int, seed: int, layout: tuple[int, int, int]
) -> None:
    world, micro, accum = layout
    global_batch = world * micro * accum
    steps = step_ids(size, seed=seed, world=world, micro=micro, accum=accum, steps=4)
    order = corpus(size, seed=seed).order
    for s, ids in enumerate(steps):
        assert ids == order.ids(s * global_batch, global_batch).tolist()
    one_rank = step_ids(size, seed=seed, world=1, micro=global_batch, accum=1, steps=4)
    assert steps == one_rank


@settings(max_examples=60, deadline=None)
@given(size=st.integers(1, 60), seed=st.integers(0, 2**16), layout=layouts, data=st.data())
def test_a_run_resumed_at_another_world_size_reads_the_same_ids(
    size: int, seed: int, layout: tuple[int, int, int], data: st.DataObject
) -> None:
    world, micro, accum = layout
    global_batch = world * micro * accum
    kill, total = data.draw(st.integers(0, 6)), 8
    world2 = data.draw(st.sampled_from([w for w in range(1, 5) if global_batch % w == 0]))
    per_rank = global_batch // world2
    micro2 = data.draw(st.sampled_from([m for m in range(1, per_rank + 1) if per_rank % m == 0]))

    uninterrupted = step_ids(size, seed=seed, world=world, micro=micro, accum=accum, steps=total)
    before = step_ids(size, seed=seed, world=world, micro=micro, accum=accum, steps=kill)
    after = step_ids(
        size,
        seed=seed,
        world=world2,
        micro=micro2,
        accum=per_rank // micro2,
        steps=total - kill,
        start_step=kill,
    )
    assert before + after == uninterrupted


@settings(max_examples=60, deadline=None)
@given(size=st.integers(1, 80), seed=st.integers(0, 2**16), epochs=st.integers(2, 4))
def test_every_epoch_reads_every_sample_once(size: int, seed: int, epochs: int) -> None:
    for shuffle in (True, False):
        order = EpochOrder(size=size, seed=seed, shuffle=shuffle)
        read = order.ids(0, size * epochs).reshape(epochs, size)
        for epoch in read:
            assert sorted(epoch.tolist()) == list(range(size))
        if not shuffle:
            assert (read == np.arange(size)).all()
        assert [order.epoch(e * size) for e in range(epochs)] == list(range(epochs))


@settings(max_examples=40, deadline=None)
@given(size=st.integers(20, 200), seed=st.integers(0, 2**16), epochs=st.integers(2, 4))
def test_shuffled_epochs_differ_and_depend_on_the_seed_alone(
    size: int, seed: int, epochs: int
) -> None:
    # 20! orders: two equal epochs would be a bug, not chance.
    read = EpochOrder(size=size, seed=seed).ids(0, size * epochs).reshape(epochs, size)
    for e in range(1, epochs):
        assert not (read[e] == read[e - 1]).all()
    again = EpochOrder(size=size, seed=seed)
    # Read backwards from a late position first: the order depends on the index alone.
    tail = again.ids(size * (epochs - 1), size)
    assert (tail == read[-1]).all() and (again.ids(0, size) == read[0]).all()


@settings(max_examples=40, deadline=None)
@given(
    size=st.integers(1, 30),
    seed=st.integers(0, 2**16),
    start=st.integers(0, 200),
    count=st.integers(1, 90),
)
def test_any_window_of_the_stream_matches_the_whole_stream(
    size: int, seed: int, start: int, count: int
) -> None:
    # Windows may span several epochs (a global batch larger than the data set).
    whole = EpochOrder(size=size, seed=seed).ids(0, start + count)
    assert (EpochOrder(size=size, seed=seed).ids(start, count) == whole[start:]).all()
