"""Markov corpus (exact entropy, floor, addressable samples) and rank sharding."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from trainstack.config import ConfigError, DataConfig
from trainstack.data import (
    DATA_SOURCES,
    EVAL_START,
    DataCursor,
    MarkovCorpus,
    ShardedBatches,
    build_corpus,
    eval_batches,
)
from trainstack.data.sharding import Batch

SEQ = 12


@pytest.fixture(scope="module")
def corpus() -> MarkovCorpus:
    return MarkovCorpus(vocab_size=16, order=2, concentration=0.3, seed=5)


def _rows(batches: list[Batch]) -> torch.Tensor:
    """Rebuild the sampled sequences x[0..seq_len] from (inputs, targets) pairs."""
    return torch.cat([torch.cat([x, y[:, -1:]], dim=1) for x, y in batches])


# ---- the chain ------------------------------------------------------------------


def test_uniform_rows_have_entropy_rate_ln_v_at_every_position() -> None:
    V = 6
    chain = MarkovCorpus.from_transitions(np.full((V**2, V), 1.0 / V), order=2)
    assert chain.entropy_rate == pytest.approx(math.log(V), abs=1e-12)
    assert chain.loss_floor(1) == pytest.approx(math.log(V), abs=1e-12)
    assert chain.loss_floor(SEQ) == pytest.approx(math.log(V), abs=1e-12)


def test_deterministic_cycle_has_zero_entropy_rate() -> None:
    V = 5
    cycle = np.roll(np.eye(V), 1, axis=1)  # token i is always followed by i + 1 mod V
    chain = MarkovCorpus.from_transitions(cycle, order=1)
    assert chain.entropy_rate == pytest.approx(0.0, abs=1e-12)
    np.testing.assert_allclose(chain.stationary, np.full(V, 1.0 / V), atol=1e-12)
    x = chain.samples(0, 4, SEQ)
    assert torch.equal(x[:, 1:], (x[:, :-1] + 1) % V)


def test_two_state_chain_entropy_rate_matches_hand_computation() -> None:
    chain = MarkovCorpus.from_transitions(np.array([[0.9, 0.1], [0.5, 0.5]]), order=1)
    pi = np.array([5 / 6, 1 / 6])  # solves pi P = pi
    h_row0 = -(0.9 * math.log(0.9) + 0.1 * math.log(0.1))
    np.testing.assert_allclose(chain.stationary, pi, atol=1e-12)
    assert chain.entropy_rate == pytest.approx(pi[0] * h_row0 + pi[1] * math.log(2), abs=1e-12)


def test_a_context_blind_model_scores_the_entropy_of_one_tokens_marginal() -> None:
    """The bar the suite's loss bounds sit under: a model that ignores the context."""
    two_state = MarkovCorpus.from_transitions(np.array([[0.9, 0.1], [0.5, 0.5]]), order=1)
    blind = -(5 / 6 * math.log(5 / 6) + 1 / 6 * math.log(1 / 6))  # pi = (5/6, 1/6)
    assert two_state.context_blind_loss() == pytest.approx(blind, abs=1e-12)
    assert two_state.context_blind_loss() > two_state.entropy_rate  # context helps here
    V = 5
    cycle = MarkovCorpus.from_transitions(np.roll(np.eye(V), 1, axis=1), order=1)
    assert cycle.context_blind_loss() == pytest.approx(math.log(V), abs=1e-12)
    suite = MarkovCorpus(vocab_size=16, order=1, concentration=0.1, seed=1234)
    assert suite.context_blind_loss() == pytest.approx(2.4241, abs=1e-4)
    order2 = MarkovCorpus(vocab_size=6, order=2, concentration=0.3, seed=0)
    tokens = order2.samples(0, 4000, 8).flatten().numpy()
    freq = np.bincount(tokens, minlength=6) / tokens.size  # the marginal, sampled
    assert order2.context_blind_loss() == pytest.approx(-(freq * np.log(freq)).sum(), abs=0.01)


def test_near_zero_concentration_gives_near_zero_entropy() -> None:
    chain = MarkovCorpus(vocab_size=8, order=1, concentration=1e-4, seed=0)
    assert 0.0 <= chain.entropy_rate < 0.01


def test_stationary_distribution_is_a_fixed_point(corpus: MarkovCorpus) -> None:
    V, k = corpus.vocab_size, corpus.order
    pi = corpus.stationary
    # Dense check on a small chain: state (a, b) moves on y to (b, y).
    dense = np.zeros((V**k, V**k))
    for s in range(V**k):
        for y in range(V):
            dense[s, (s % V ** (k - 1)) * V + y] += corpus.transitions[s, y]
    np.testing.assert_allclose(pi @ dense, pi, atol=1e-11)
    assert pi.sum() == pytest.approx(1.0)


def test_loss_floor_exceeds_entropy_rate_only_by_the_partial_context_prefix(
    corpus: MarkovCorpus,
) -> None:
    # Order 2: target 1 sees one token, targets 2.. see their whole state.
    h1 = corpus.loss_floor(1)
    assert h1 > corpus.entropy_rate
    assert corpus.loss_floor(SEQ) == pytest.approx((h1 + (SEQ - 1) * corpus.entropy_rate) / SEQ)


def _empirical_nll(corpus: MarkovCorpus, x: np.ndarray) -> float:
    """Mean -log P(x_t | x_0..x_{t-1}) over targets t = 1..T, from the chain's own tables."""
    V, k = corpus.vocab_size, corpus.order
    nll = []
    for t in range(1, x.shape[1]):
        if t < k:  # partial context: P(x_t | x_<t) from marginals of the stationary pi
            joint = corpus.stationary.reshape(V ** (t + 1), V ** (k - t - 1)).sum(axis=1)
            prefix = corpus.stationary.reshape(V**t, V ** (k - t)).sum(axis=1)
            code = np.zeros(len(x), dtype=np.int64)
            for j in range(t):
                code = code * V + x[:, j]
            p = joint[code * V + x[:, t]] / prefix[code]
        else:
            state = np.zeros(len(x), dtype=np.int64)
            for j in range(t - k, t):
                state = state * V + x[:, j]
            p = corpus.transitions[state, x[:, t]]
        nll.append(-np.log(p))
    return float(np.mean(nll))


@pytest.mark.parametrize("seq_len", [1, SEQ])
def test_sampler_reaches_exactly_the_loss_floor(corpus: MarkovCorpus, seq_len: int) -> None:
    x = corpus.samples(0, 20_000, seq_len).numpy()
    assert _empirical_nll(corpus, x) == pytest.approx(corpus.loss_floor(seq_len), rel=0.01)


def test_first_tokens_follow_the_stationary_distribution(corpus: MarkovCorpus) -> None:
    V = corpus.vocab_size
    x = corpus.samples(0, 50_000, 2).numpy()
    first = np.bincount(x[:, 0], minlength=V) / len(x)
    marginal = corpus.stationary.reshape(V, V).sum(axis=1)
    np.testing.assert_allclose(first, marginal, atol=0.01)


def test_samples_are_a_function_of_index_not_window(corpus: MarkovCorpus) -> None:
    whole = corpus.samples(0, 10, SEQ)
    assert whole.shape == (10, SEQ + 1) and whole.dtype == torch.int64
    assert torch.equal(corpus.samples(5, 3, SEQ), whole[5:8])
    assert torch.equal(corpus.samples(0, 10, SEQ), whole)
    assert torch.equal(corpus.samples(9, 1, SEQ)[0], whole[9])
    assert torch.equal(corpus.samples(0, 10, 4), whole[:, :5])  # longer samples extend


def test_samples_depend_on_the_seed() -> None:
    a = MarkovCorpus(vocab_size=16, order=1, concentration=1.0, seed=1)
    b = MarkovCorpus.from_transitions(a.transitions, order=1, seed=2)
    c = MarkovCorpus.from_transitions(a.transitions, order=1, seed=1)
    assert not torch.equal(a.samples(0, 8, SEQ), b.samples(0, 8, SEQ))
    assert torch.equal(a.samples(0, 8, SEQ), c.samples(0, 8, SEQ))


def test_build_corpus_follows_the_data_spec() -> None:
    cfg = DataConfig(vocab_size=12, order=2, concentration=0.5, seed=3)
    built = build_corpus(cfg)
    direct = MarkovCorpus(vocab_size=12, order=2, concentration=0.5, seed=3)
    assert DATA_SOURCES["markov"] is MarkovCorpus
    np.testing.assert_array_equal(built.transitions, direct.transitions)
    assert torch.equal(built.samples(0, 4, SEQ), direct.samples(0, 4, SEQ))
    x, y = built.train_batch(0, 4, seq_len=SEQ)
    assert torch.equal(x, direct.samples(0, 4, SEQ)[:, :-1])
    assert torch.equal(y, direct.samples(0, 4, SEQ)[:, 1:])
    with pytest.raises(ConfigError, match=r"data\.kind"):
        build_corpus(DataConfig(kind="wiki"))


# ---- sharding -------------------------------------------------------------------


def _run_steps(
    corpus: MarkovCorpus, *, world_size: int, micro: int, steps: int
) -> list[list[Batch]]:
    """Per step, every rank's micro-batches in layout order (micro-step, then rank)."""
    loaders = [
        ShardedBatches(
            corpus=corpus,
            seq_len=SEQ,
            global_batch_size=16,
            micro_batch_size=micro,
            rank=r,
            world_size=world_size,
            cursor=DataCursor(),
        )
        for r in range(world_size)
    ]
    per_step = []
    for _ in range(steps):
        per_rank = [loader.next_step() for loader in loaders]
        accum = len(per_rank[0])
        per_step.append([per_rank[r][a] for a in range(accum) for r in range(world_size)])
    return per_step


def test_two_workers_see_exactly_the_one_worker_global_batch(corpus: MarkovCorpus) -> None:
    G = 16
    two = _run_steps(corpus, world_size=2, micro=4, steps=3)
    one = _run_steps(corpus, world_size=1, micro=8, steps=3)
    for step in range(3):
        rows_two, rows_one = _rows(two[step]), _rows(one[step])
        assert {tuple(r) for r in rows_two.tolist()} == {tuple(r) for r in rows_one.tolist()}
        # Not only the same set: exactly samples [step*G, (step+1)*G), in layout order.
        expected = corpus.samples(step * G, G, SEQ)
        assert torch.equal(rows_two, expected)
        assert torch.equal(rows_one, expected)


def test_micro_batches_are_shifted_inputs_and_targets(corpus: MarkovCorpus) -> None:
    loader = ShardedBatches(
        corpus=corpus, seq_len=SEQ, global_batch_size=8, micro_batch_size=4, rank=1, world_size=2
    )
    ((x, y),) = loader.next_step()
    full = corpus.samples(4, 4, SEQ)
    assert x.shape == y.shape == (4, SEQ)
    assert torch.equal(x, full[:, :-1]) and torch.equal(y, full[:, 1:])
    assert loader.cursor.samples_seen == 8


def test_resume_with_fewer_workers_continues_at_the_next_global_sample(
    corpus: MarkovCorpus,
) -> None:
    G = 16
    loaders = [
        ShardedBatches(
            corpus=corpus,
            seq_len=SEQ,
            global_batch_size=G,
            micro_batch_size=4,
            rank=r,
            world_size=2,
            cursor=DataCursor(),
        )
        for r in range(2)
    ]
    for _ in range(2):
        for loader in loaders:
            loader.next_step()
    saved = loaders[0].cursor.state_dict()
    assert saved == loaders[1].cursor.state_dict() == {"samples_seen": 2 * G}

    cursor = DataCursor.from_state_dict(saved)
    resumed = ShardedBatches(
        corpus=corpus,
        seq_len=SEQ,
        global_batch_size=G,
        micro_batch_size=8,
        rank=0,
        world_size=1,
        cursor=cursor,
    )
    assert torch.equal(_rows(resumed.next_step()), corpus.samples(2 * G, G, SEQ))
    assert cursor.samples_seen == 3 * G


def test_global_batch_not_divisible_by_micro_times_world_is_rejected(
    corpus: MarkovCorpus,
) -> None:
    with pytest.raises(ValueError, match="not a multiple"):
        ShardedBatches(
            corpus=corpus,
            seq_len=SEQ,
            global_batch_size=12,
            micro_batch_size=4,
            rank=0,
            world_size=2,
        )


@pytest.mark.parametrize("world_size", [1, 3, 40])
def test_eval_shares_cover_the_held_out_set_exactly_once(
    corpus: MarkovCorpus, world_size: int
) -> None:
    count = 37
    shares = [
        eval_batches(
            corpus, count=count, seq_len=SEQ, micro_batch_size=5, rank=r, world_size=world_size
        )
        for r in range(world_size)
    ]
    assert all(x.shape[0] <= 5 for share in shares for x, _ in share)
    union = torch.cat([_rows(share) for share in shares if share])
    assert torch.equal(union, corpus.eval_samples(count, SEQ))
    assert torch.equal(union, corpus.samples(EVAL_START, count, SEQ))


def test_eval_set_is_disjoint_from_training_samples(corpus: MarkovCorpus) -> None:
    # A disjoint index range; with 16**13 possible sequences, a shared row would mean
    # the two ranges reuse the same uniforms.
    train = {tuple(r) for r in corpus.samples(0, 4096, SEQ).tolist()}
    held_out = {tuple(r) for r in corpus.eval_samples(256, SEQ).tolist()}
    assert EVAL_START > 4096
    assert not train & held_out
