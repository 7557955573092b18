"""Clusters corpus: samples are a function of (seed, index), the held-out set is its own,
classify batches shard like any other, and the Bayes figures are the ideal classifier's
on the very samples a run evaluates."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from trainstack.config import ConfigError, DataConfig, config_from_dict
from trainstack.data import (
    DATA_SOURCES,
    EVAL_START,
    ClustersCorpus,
    DataCursor,
    ShardedBatches,
    build_corpus,
    eval_batches,
)
from trainstack.data.clusters import TEMPLATE_NORM
from trainstack.data.sharding import Batch

SEQ = 7  # ignored by clusters; passed anyway, as the loop does


@pytest.fixture(scope="module")
def corpus() -> ClustersCorpus:
    return ClustersCorpus.from_config(DataConfig(kind="clusters", eval_samples=512))


def _cat(batches: list[Batch]) -> Batch:
    return torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])


def _assert_same(a: Batch, b: Batch) -> None:
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_build_corpus_follows_the_data_spec() -> None:
    cfg = DataConfig(kind="clusters", num_classes=7, shape=(3, 5), noise=0.5, seed=3)
    built = build_corpus(cfg)
    assert isinstance(built, ClustersCorpus) and DATA_SOURCES["clusters"] is ClustersCorpus
    assert built.templates.shape == (7, 3, 5)
    norms = np.linalg.norm(built.templates.reshape(7, -1), axis=1)
    np.testing.assert_allclose(norms, TEMPLATE_NORM)
    x, y = built.train_batch(10, 6, seq_len=SEQ)
    assert x.shape == (6, 3, 5) and x.dtype == torch.float32
    assert y.shape == (6,) and y.dtype == torch.int64


def test_a_batch_is_the_concatenation_of_any_split_of_its_indices(
    corpus: ClustersCorpus,
) -> None:
    whole = corpus.train_batch(100, 40, seq_len=SEQ)
    rng = np.random.default_rng(0)
    for _ in range(5):
        cuts = sorted(rng.choice(np.arange(1, 40), size=4, replace=False).tolist())
        bounds = [0, *cuts, 40]
        parts = [
            corpus.train_batch(100 + a, b - a, seq_len=SEQ) for a, b in itertools.pairwise(bounds)
        ]
        _assert_same(_cat(parts), whole)
    _assert_same(corpus.train_batch(137, 1, seq_len=SEQ), (whole[0][37:38], whole[1][37:38]))
    # A larger held-out set extends the same rows.
    small, large = corpus.held_out_batch(20, seq_len=SEQ), corpus.held_out_batch(50, seq_len=SEQ)
    _assert_same(small, (large[0][:20], large[1][:20]))


def test_samples_depend_on_the_seed_only_through_it() -> None:
    def make(seed: int) -> ClustersCorpus:
        return ClustersCorpus(num_classes=10, shape=(1, 8, 8), noise=1.0, seed=seed, eval_samples=0)

    a, b, c = make(1), make(1), make(2)
    _assert_same(a.train_batch(0, 8, seq_len=SEQ), b.train_batch(0, 8, seq_len=SEQ))
    assert not torch.equal(a.train_batch(0, 8, seq_len=SEQ)[0], c.train_batch(0, 8, seq_len=SEQ)[0])


def test_inputs_are_their_template_plus_gaussian_noise_of_the_given_scale() -> None:
    noisy = ClustersCorpus(num_classes=4, shape=(16,), noise=2.5, seed=0, eval_samples=0)
    x, y = noisy.train_batch(0, 20_000, seq_len=SEQ)
    residual = x.double().numpy() - noisy.templates[y.numpy()]
    assert residual.mean() == pytest.approx(0.0, abs=0.01)
    assert residual.std() == pytest.approx(2.5, rel=0.01)
    np.testing.assert_allclose(np.corrcoef(residual[:, :4].T), np.eye(4), atol=0.02)
    labels = np.bincount(y.numpy(), minlength=4) / len(y)
    np.testing.assert_allclose(labels, 0.25, atol=0.01)


def test_held_out_samples_are_disjoint_from_training(corpus: ClustersCorpus) -> None:
    train, _ = corpus.train_batch(0, 4096, seq_len=SEQ)
    held_out, _ = corpus.held_out_batch(512, seq_len=SEQ)
    assert EVAL_START > 4096
    _assert_same(
        corpus.held_out_batch(512, seq_len=SEQ), corpus.train_batch(EVAL_START, 512, seq_len=SEQ)
    )
    # Continuous inputs: a shared row would mean both ranges reuse the same uniforms.
    rows = {r.tobytes() for r in train.numpy()}
    assert not any(r.tobytes() in rows for r in held_out.numpy())


def _step_rows(corpus: ClustersCorpus, *, world_size: int, micro: int, steps: int) -> list[Batch]:
    """Each step's micro-batches of all ranks, concatenated in layout order
    (micro-step, then rank)."""
    loaders = [
        ShardedBatches(
            corpus=corpus,
            seq_len=SEQ,
            global_batch_size=24,
            micro_batch_size=micro,
            rank=r,
            world_size=world_size,
            cursor=DataCursor(),
        )
        for r in range(world_size)
    ]
    out = []
    for _ in range(steps):
        per_rank = [loader.next_step() for loader in loaders]
        accum = len(per_rank[0])
        out.append(_cat([per_rank[r][a] for a in range(accum) for r in range(world_size)]))
    return out


@pytest.mark.parametrize(("world_size", "micro"), [(1, 24), (1, 6), (2, 4), (3, 8), (4, 3)])
def test_every_layout_sees_the_one_rank_global_batch(
    corpus: ClustersCorpus, world_size: int, micro: int
) -> None:
    G = 24
    reference = _step_rows(corpus, world_size=1, micro=G, steps=3)
    for step, rows in enumerate(_step_rows(corpus, world_size=world_size, micro=micro, steps=3)):
        _assert_same(rows, reference[step])
        _assert_same(rows, corpus.train_batch(step * G, G, seq_len=SEQ))


@pytest.mark.parametrize("world_size", [1, 3, 40])
def test_eval_shares_cover_the_held_out_set_exactly_once(
    corpus: ClustersCorpus, world_size: int
) -> None:
    count = 37
    shares = [
        eval_batches(
            corpus, count=count, seq_len=SEQ, micro_batch_size=5, rank=r, world_size=world_size
        )
        for r in range(world_size)
    ]
    assert all(x.shape[0] == y.shape[0] <= 5 for share in shares for x, y in share)
    _assert_same(
        _cat([b for share in shares for b in share]), corpus.held_out_batch(count, seq_len=SEQ)
    )


def test_nearest_template_accuracy_on_held_out_is_the_bayes_accuracy(
    corpus: ClustersCorpus,
) -> None:
    x, y = corpus.held_out_batch(512, seq_len=SEQ)
    templates = torch.from_numpy(corpus.templates).flatten(1)
    nearest = torch.cdist(x.flatten(1).double(), templates).argmin(dim=1)
    assert corpus.bayes_accuracy(512) == (nearest == y).double().mean().item()


def test_loss_floor_is_the_exact_posterior_cross_entropy_on_the_evaluated_samples(
    corpus: ClustersCorpus,
) -> None:
    x, y = corpus.held_out_batch(512, seq_len=SEQ)
    sq_dist = torch.cdist(x.flatten(1).double(), torch.from_numpy(corpus.templates).flatten(1))
    log_posterior = torch.log_softmax(-(sq_dist**2) / (2 * corpus.noise**2), dim=1)
    expected = -log_posterior[torch.arange(512), y].mean().item()
    assert corpus.loss_floor(SEQ) == pytest.approx(expected, rel=1e-9)
    assert corpus.loss_floor(SEQ) == corpus.bayes_loss(512)


def test_default_task_is_hard_but_learnable() -> None:
    # Measured with the defaults (10 classes, shape (1, 8, 8), noise 1.0, seed 1234):
    # Bayes accuracy 0.9805 on the first 256 and 512 held-out samples, 0.9762 on 100,000;
    # Bayes cross-entropy 0.052 (256), 0.058 (512), 0.070 (100,000) nats; ln 10 = 2.30.
    corpus = build_corpus(DataConfig(kind="clusters"))
    assert isinstance(corpus, ClustersCorpus) and corpus.eval_samples == 256
    assert 0.95 <= corpus.bayes_accuracy(4096) <= 0.99
    floor = corpus.loss_floor(SEQ)
    assert 0.0 < floor < math.log(10)
    assert 0.02 < floor < 0.15


def test_more_noise_lowers_the_bayes_accuracy_and_raises_the_floor() -> None:
    def figures(noise: float) -> tuple[float, float]:
        c = ClustersCorpus(num_classes=10, shape=(1, 8, 8), noise=noise, seed=1, eval_samples=1024)
        return c.bayes_accuracy(1024), c.loss_floor(SEQ)

    (acc_low, floor_low), (acc_high, floor_high) = figures(0.5), figures(2.0)
    assert acc_low > 0.999 and floor_low < 1e-3
    assert acc_high < 0.7 and floor_high > 0.8


def test_without_evaluation_the_floor_is_taken_on_a_fixed_held_out_set() -> None:
    c = ClustersCorpus(num_classes=10, shape=(1, 8, 8), noise=1.0, seed=1, eval_samples=0)
    assert c.loss_floor(SEQ) == c.bayes_loss(4096)


def test_too_many_template_entries_is_one_config_error() -> None:
    spec = {"data": {"kind": "clusters", "num_classes": 1000, "shape": [1, 256, 256]}}
    spec |= {"task": {"kind": "classify"}, "model": {"kind": "custom", "target": "a:b"}}
    with pytest.raises(ConfigError, match=r"1000 × \[1, 256, 256\] gives 65536000 template"):
        config_from_dict(spec)


def test_generation_is_cheap(corpus: ClustersCorpus) -> None:
    # About 400k samples/s of shape (1, 8, 8) on one CPU core (measured); no time assertion.
    x, y = corpus.train_batch(0, 20_000, seq_len=SEQ)
    assert x.shape == (20_000, 1, 8, 8) and y.shape == (20_000,)
