"""Synthetic labelled inputs around class templates, with an exactly known Bayes accuracy.

`num_classes` templates mu_c of shape `shape`, each a random direction of norm
TEMPLATE_NORM drawn from `seed`. Sample i has a label y uniform over the classes and
the input x = mu_y + noise * z, z ~ N(0, I). The classes are equally likely Gaussians
with one isotropic covariance, so the ideal (Bayes) classifier is known exactly:
P(c | x) = softmax_c(-|x - mu_c|^2 / (2 noise^2)), and the nearest template wins.
The templates' norm does not grow with the input's size, so how hard the task is
depends on `noise` and `num_classes`, hardly on `shape`. With the defaults (10
classes, shape (1, 8, 8), noise 1.0, seed 1234) the Bayes accuracy is about 98%
(0.9805 on the first 256 held-out samples, 0.9762 on 100,000) and the Bayes
cross-entropy 0.05 to 0.07 nats (0.052 on 256, 0.070 on 100,000; chance is ln 10 =
2.30): not trivially 100%, and a one-convolution CNN of width 8 comes within a point
of the Bayes accuracy in 150 steps of 64 samples.

Samples are addressed by a global index as in markov.py: sample i is a function of
(seed, i) alone, computed from the same counter-based uniforms (`index_uniforms`):
uniform 0 picks the label, the next ones give the noise by Box-Muller. Training uses
indices [0, EVAL_START); the held-out set starts at EVAL_START.
"""

from __future__ import annotations

import hashlib
import json
import math

import numpy as np
import torch

from trainstack.config import DataConfig
from trainstack.config.checks.allowed import MAX_TEMPLATE_NUMEL
from trainstack.data.markov import EVAL_START, index_uniforms, stream_key
from trainstack.data.sharding import Batch

TEMPLATE_NORM = 4.0
"""Euclidean norm of every class template: with noise 1.0, 10 classes are ~98% separable."""

FLOOR_SAMPLES_WITHOUT_EVAL = 4096
"""Held-out samples `loss_floor` averages over when the run evaluates none."""

_CHUNK_ENTRIES = 2**22
"""Uniforms drawn at once while generating a batch (bounds the float64 temporaries)."""


class ClustersCorpus:
    """`num_classes` Gaussian clusters around seeded templates, sampled by index."""

    num_classes: int
    shape: tuple[int, ...]
    """Shape of one input, e.g. (1, 8, 8)."""
    noise: float
    """Standard deviation of the Gaussian noise around each template."""
    seed: int
    eval_samples: int
    """Held-out samples the run evaluates on; `loss_floor` is exact for these."""
    templates: np.ndarray
    """float64 [num_classes, *shape], each of norm TEMPLATE_NORM."""

    def __init__(
        self,
        *,
        num_classes: int,
        shape: tuple[int, ...],
        noise: float,
        seed: int,
        eval_samples: int,
    ) -> None:
        dim = math.prod(shape)
        assert num_classes * dim <= MAX_TEMPLATE_NUMEL, "config validation bounds the templates"
        self.num_classes = num_classes
        self.shape = tuple(shape)
        self.noise = noise
        self.seed = seed
        self.eval_samples = eval_samples
        flat = np.random.default_rng(seed).standard_normal((num_classes, dim))
        flat *= TEMPLATE_NORM / np.linalg.norm(flat, axis=1, keepdims=True)
        self._flat = flat
        self.templates = flat.reshape(num_classes, *self.shape)
        self._key = stream_key(seed)

    @classmethod
    def from_config(cls, cfg: DataConfig) -> ClustersCorpus:
        """The corpus the spec's data section describes."""
        return cls(
            num_classes=cfg.num_classes,
            shape=tuple(cfg.shape),
            noise=cfg.noise,
            seed=cfg.seed,
            eval_samples=cfg.eval_samples,
        )

    @property
    def fingerprint(self) -> str:
        """Digest of the parameters that determine every sample: num_classes, shape,
        noise and seed (eval_samples only chooses how many are evaluated)."""
        what = {
            "kind": "clusters",
            "num_classes": self.num_classes,
            "shape": list(self.shape),
            "noise": self.noise,
            "seed": self.seed,
        }
        return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()

    def train_batch(self, start: int, count: int, *, seq_len: int) -> Batch:
        """Training samples start..start+count-1: inputs float32 [count, *shape] and
        labels int64 [count]. Row i depends only on (seed, start + i); seq_len is ignored."""
        return self._draw(start, count)

    def held_out_batch(self, count: int, *, seq_len: int) -> Batch:
        """The first `count` held-out samples (indices EVAL_START..), like `train_batch`."""
        return self._draw(EVAL_START, count)

    def _draw(self, start: int, count: int) -> Batch:
        """Samples start..start+count-1, generated a chunk of rows at a time."""
        dim = self._flat.shape[1]
        pairs = (dim + 1) // 2  # Box-Muller turns two uniforms into two normals
        width = 1 + 2 * pairs
        inputs = np.empty((count, dim), dtype=np.float32)
        labels = np.empty(count, dtype=np.int64)
        rows = max(1, _CHUNK_ENTRIES // width)
        for lo in range(0, count, rows):
            hi = min(count, lo + rows)
            index = np.arange(start + lo, start + hi, dtype=np.uint64)
            u = index_uniforms(self._key, index, width)
            y = np.minimum((u[:, 0] * self.num_classes).astype(np.int64), self.num_classes - 1)
            radius = np.sqrt(-2.0 * np.log1p(-u[:, 1::2]))  # 1 - u is in (0, 1]
            angle = 2.0 * math.pi * u[:, 2::2]
            z = np.stack([radius * np.cos(angle), radius * np.sin(angle)], axis=-1)
            inputs[lo:hi] = self._flat[y] + self.noise * z.reshape(hi - lo, 2 * pairs)[:, :dim]
            labels[lo:hi] = y
        return torch.from_numpy(inputs.reshape(count, *self.shape)), torch.from_numpy(labels)

    def bayes_logits(self, count: int) -> tuple[np.ndarray, np.ndarray]:
        """The ideal classifier on the first `count` held-out samples: float64 log-posteriors
        (up to a per-row constant) [count, num_classes], and the labels [count].

        log P(c | x) = (x . mu_c - |mu_c|^2 / 2) / noise^2 + const(x), from the true
        templates and noise with equal priors, on the float32 inputs a model is given.
        """
        x, y = self.held_out_batch(count, seq_len=0)
        flat = x.numpy().reshape(count, -1).astype(np.float64)
        sq_norms = (self._flat**2).sum(axis=1)
        logits = (flat @ self._flat.T - 0.5 * sq_norms) / self.noise**2
        return logits, y.numpy()

    def bayes_accuracy(self, count: int) -> float:
        """Accuracy of the Bayes classifier (the nearest template) on the first `count`
        held-out samples: exact for those samples, the ideal classifier's figure on the
        very data a run evaluates (a trained model can differ from it only by chance)."""
        if count < 1:
            raise ValueError(f"count={count}: need at least one held-out sample")
        logits, labels = self.bayes_logits(count)
        return float((logits.argmax(axis=1) == labels).mean())

    def bayes_loss(self, count: int) -> float:
        """Mean cross-entropy (nats) of the exact posterior on the first `count` held-out
        samples: exact for those samples, like `bayes_accuracy`."""
        if count < 1:
            raise ValueError(f"count={count}: need at least one held-out sample")
        logits, labels = self.bayes_logits(count)
        peak = logits.max(axis=1)
        log_norm = peak + np.log(np.exp(logits - peak[:, None]).sum(axis=1))
        return float((log_norm - logits[np.arange(count), labels]).mean())

    def epoch(self, samples_seen: int, *, seq_len: int) -> int:
        """The stream never repeats: every sample is in epoch 0."""
        return 0

    def loss_floor(self, seq_len: int) -> float:
        """The Bayes cross-entropy on the held-out set the run evaluates (`bayes_loss` of
        its first `eval_samples`, or of FLOOR_SAMPLES_WITHOUT_EVAL when it evaluates
        none); seq_len is ignored. A perfect model's evaluation loss is this number."""
        return self.bayes_loss(self.eval_samples or FLOOR_SAMPLES_WITHOUT_EVAL)
