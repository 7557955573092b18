"""Synthetic Markov-chain text with an exactly known loss floor.

A chain of order k over a vocabulary of V tokens: the state is the last k tokens,
encoded base V with the oldest token most significant, so state s moves on token y
to `(s % V**(k-1)) * V + y`. Each of the V**k states has a transition row drawn from
Dirichlet(concentration * 1_V). Sequences start from the chain's stationary
distribution over k-tuples, so every position is distributed alike and the entropy
rate is the floor of the cross-entropy a perfect model reaches.

Samples are addressed by a global index: sample i is a function of (seed, i) alone,
computed from counter-based uniforms (a splitmix64 hash, `index_uniforms`, which
the clusters source shares), so any window of the stream can be produced without the
samples before it. Training uses indices [0, 2**40); the held-out evaluation set
starts at EVAL_START = 2**40.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math

import numpy as np
import torch

from trainstack.config import ConfigError, DataConfig
from trainstack.data.sharding import Batch

EVAL_START = 2**40
"""First global index of the evaluation samples; training indices stay below it."""

MAX_TRANSITION_ENTRIES = 2**26
"""Largest V**(order+1) allowed: the transition table is held densely in float64."""

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser on uint64 arrays (wrapping arithmetic)."""
    z = x + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def stream_key(seed: int) -> np.uint64:
    """The 64-bit key of a seed's sample stream, for `index_uniforms`."""
    key: np.uint64 = _splitmix64(np.array([seed % 2**64], dtype=np.uint64))[0]
    return key


def index_uniforms(key: np.uint64, index: np.ndarray, width: int) -> np.ndarray:
    """float64 [len(index), width] uniforms in [0, 1), counter-based.

    Entry (i, p) is a splitmix64 hash of (key, index[i], p) alone: a row depends only
    on its global index, and a wider call extends the same row.
    """
    row_key = _splitmix64(key ^ _splitmix64(index.astype(np.uint64)))
    pos = np.arange(width, dtype=np.uint64) * _GOLDEN
    bits = _splitmix64(row_key[:, None] + pos[None, :])
    uniforms: np.ndarray = (bits >> np.uint64(11)).astype(np.float64) * 2.0**-53
    return uniforms


def _shifted(x: torch.Tensor) -> Batch:
    """Next-token pairs of token windows [b, T + 1]: (x[:, :-1], x[:, 1:])."""
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def _entropy(p: np.ndarray, axis: int = -1) -> np.ndarray:
    """Shannon entropy in nats along `axis`, with 0 log 0 = 0."""
    logp = np.log(np.where(p > 0, p, 1.0))
    return -(p * logp).sum(axis=axis)


class MarkovCorpus:
    """A Markov chain of order `order` over `vocab_size` tokens, sampled by index."""

    vocab_size: int
    order: int
    seed: int
    concentration: float
    """Dirichlet concentration of the rows (NaN for `from_transitions`)."""
    transitions: np.ndarray
    """P(next token | state), shape (V**order, V)."""
    stationary: np.ndarray
    """Stationary distribution over states (k-tuples), shape (V**order,)."""
    entropy_rate: float
    """Exact entropy rate in nats/token: sum_s pi(s) H(P(.|s))."""

    def __init__(self, *, vocab_size: int, order: int, concentration: float, seed: int) -> None:
        if vocab_size ** (order + 1) > MAX_TRANSITION_ENTRIES:
            raise ConfigError(
                f"data: vocab_size**(order+1) = {vocab_size}**{order + 1} is more than "
                f"{MAX_TRANSITION_ENTRIES} transition entries; lower vocab_size or order"
            )
        rng = np.random.default_rng(seed)
        alpha = np.full(vocab_size, concentration)
        trans = rng.dirichlet(alpha, size=vocab_size**order)
        self._setup(trans, order=order, seed=seed)
        self.concentration = concentration

    @classmethod
    def from_config(cls, cfg: DataConfig) -> MarkovCorpus:
        """The corpus the spec's data section describes."""
        return cls(
            vocab_size=cfg.vocab_size,
            order=cfg.order,
            concentration=cfg.concentration,
            seed=cfg.seed,
        )

    @classmethod
    def from_transitions(cls, trans: np.ndarray, order: int, *, seed: int = 0) -> MarkovCorpus:
        """A corpus with the given transition rows, shape (V**order, V), each summing to 1."""
        trans = np.asarray(trans, dtype=np.float64)
        vocab_size = trans.shape[1]
        if trans.shape != (vocab_size**order, vocab_size):
            raise ValueError(f"transitions of shape {trans.shape}; need (V**order, V)")
        if not np.allclose(trans.sum(axis=1), 1.0) or (trans < 0).any():
            raise ValueError("each transition row must be a probability distribution")
        corpus = cls.__new__(cls)
        corpus._setup(trans, order=order, seed=seed)
        corpus.concentration = math.nan
        return corpus

    def _setup(self, trans: np.ndarray, *, order: int, seed: int) -> None:
        self.vocab_size = trans.shape[1]
        self.order = order
        self.seed = seed
        self.transitions = trans / trans.sum(axis=1, keepdims=True)
        self.stationary = self._stationary_distribution()
        self.entropy_rate = float(self.stationary @ _entropy(self.transitions))

        cum = np.cumsum(self.transitions, axis=1)
        cum[:, -1] = 1.0  # every u in [0, 1) lands in a row, whatever the rounding
        self._cum_rows = cum.ravel()
        self._cum_stationary = np.cumsum(self.stationary)
        self._cum_stationary[-1] = 1.0
        self._key = stream_key(seed)

    def _stationary_distribution(self, tol: float = 1e-12, max_iter: int = 100_000) -> np.ndarray:
        """Stationary distribution over k-tuples by power iteration (L1 change < tol).

        State s = (a, b) with a the oldest token and b the other k-1 moves on token y
        to (b, y), so one step is pi'(b, y) = sum_a pi(a, b) P(y | a, b): a batched
        vector-matrix product over b, never a V**k x V**k matrix. The damped chain
        0.1 I + 0.9 P has the same stationary distribution and is aperiodic, so the
        iteration converges for periodic chains too.
        """
        V, k = self.vocab_size, self.order
        by_oldest = self.transitions.reshape(V, V ** (k - 1), V)
        pi = np.full(V**k, 1.0 / V**k)
        for _ in range(max_iter):
            flow = np.einsum("ab,aby->by", pi.reshape(V, V ** (k - 1)), by_oldest).ravel()
            new = 0.1 * pi + 0.9 * flow
            new /= new.sum()
            if np.abs(new - pi).sum() < tol:
                return new
            pi = new
        raise ValueError(
            f"the stationary distribution did not converge in {max_iter} steps; "
            "the chain mixes too slowly (raise data.concentration)"
        )

    @functools.cached_property
    def fingerprint(self) -> str:
        """Digest of the parameters that determine every sample: vocab_size, order,
        concentration and seed (or, from `from_transitions`, the rows themselves)."""
        what: dict[str, object] = {"kind": "markov", "order": self.order, "seed": self.seed}
        if math.isnan(self.concentration):
            what["transitions"] = hashlib.sha256(self.transitions.tobytes()).hexdigest()
        else:
            what.update(vocab_size=self.vocab_size, concentration=self.concentration)
        return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()

    def epoch(self, samples_seen: int, *, seq_len: int) -> int:
        """The stream never repeats: every sample is in epoch 0."""
        return 0

    def context_blind_loss(self) -> float:
        """The lowest mean cross-entropy (nats) of a model that ignores every earlier token:
        the entropy of one token's stationary marginal. Below it, a model has learned
        something of the context (on the vocab-16 order-1 language of the tests: 2.424,
        against the floor's 1.139 and uniform guessing's ln 16 = 2.773)."""
        V, k = self.vocab_size, self.order
        return float(_entropy(self.stationary.reshape(V ** (k - 1), V).sum(axis=0)))

    def loss_floor(self, seq_len: int) -> float:
        """The lowest mean cross-entropy (nats) any model can reach on this data.

        For a sample x[0..seq_len] of the stationary chain, predicting targets
        x[1..seq_len] from the tokens before each: a target at position t >= order
        sees its whole state and costs the entropy rate; one at t < order costs
        H(X_t | X_0..X_{t-1}) = H(X_0..X_t) - H(X_0..X_{t-1}), from the marginals
        of the stationary distribution. Returns the mean over the seq_len targets;
        a perfect model's evaluation loss converges to this.
        """
        V, k = self.vocab_size, self.order
        joint = [0.0]  # joint[j] = H(X_0..X_{j-1})
        for j in range(1, k + 1):
            marginal = self.stationary.reshape(V**j, V ** (k - j)).sum(axis=1)
            joint.append(float(_entropy(marginal)))
        per_target = [
            joint[t + 1] - joint[t] if t < k else self.entropy_rate for t in range(1, seq_len + 1)
        ]
        return sum(per_target) / seq_len

    def samples(self, start: int, count: int, seq_len: int) -> torch.Tensor:
        """Samples start..start+count-1 of the stream, as int64 tokens [count, seq_len + 1].

        Row i depends only on (seed, start + i): uniforms u[i, p] hash (seed, index,
        position); the first `order` tokens are the stationary k-tuple picked by
        u[i, 0], each later token is drawn by inverse CDF of its state's row.
        Position p always uses u[i, p], so a longer seq_len extends the same sample.
        """
        V, k = self.vocab_size, self.order
        n_tokens = seq_len + 1
        index = np.arange(start, start + count, dtype=np.uint64)
        u = index_uniforms(self._key, index, n_tokens)  # [count, n_tokens] in [0, 1)

        out = np.empty((count, max(n_tokens, k)), dtype=np.int64)
        state = np.searchsorted(self._cum_stationary, u[:, 0], side="right")
        state = np.minimum(state, V**k - 1)
        for j in range(k):
            out[:, j] = (state // V ** (k - 1 - j)) % V
        for p in range(k, n_tokens):
            token = self._next_token(state, u[:, p])
            out[:, p] = token
            state = (state % V ** (k - 1)) * V + token
        return torch.from_numpy(out[:, :n_tokens])

    def _next_token(self, state: np.ndarray, u: np.ndarray) -> np.ndarray:
        """Inverse CDF per row: the first y with cum P(y | state) > u, by bisection.

        All rows are bisected together in ceil(log2 V) vectorised steps; exact, and
        it never touches more than log2 V entries of a row.
        """
        V = self.vocab_size
        base = state * V
        lo = np.zeros(len(u), dtype=np.int64)
        hi = np.full(len(u), V - 1, dtype=np.int64)  # the answer is always in [lo, hi]
        for _ in range((V - 1).bit_length()):
            mid = (lo + hi) >> 1
            right = self._cum_rows[base + mid] <= u
            lo = np.where(right, mid + 1, lo)
            hi = np.where(right, hi, mid)
        return lo

    def eval_samples(self, count: int, seq_len: int) -> torch.Tensor:
        """The held-out set: samples EVAL_START..EVAL_START+count-1, disjoint from training."""
        return self.samples(EVAL_START, count, seq_len)

    def train_batch(self, start: int, count: int, *, seq_len: int) -> Batch:
        """Training samples start..start+count-1 as next-token pairs: (inputs, targets),
        both int64 [count, seq_len], targets the inputs shifted left by one token."""
        return _shifted(self.samples(start, count, seq_len))

    def held_out_batch(self, count: int, *, seq_len: int) -> Batch:
        """The first `count` held-out samples as next-token pairs, like `train_batch`."""
        return _shifted(self.eval_samples(count, seq_len))
