"""Data sources (an explicit name -> class dict) and deterministic rank sharding.

Every source serves `(inputs, targets)` micro-batches by global sample index
(`sharding.Corpus`): `markov` token windows for `task.kind: lm`, `clusters` labelled
inputs for `task.kind: classify`.
"""

from __future__ import annotations

from trainstack.config import ConfigError, DataConfig
from trainstack.data.clusters import ClustersCorpus
from trainstack.data.markov import EVAL_START, MarkovCorpus
from trainstack.data.sharding import Batch, Corpus, DataCursor, ShardedBatches, eval_batches

Source = MarkovCorpus | ClustersCorpus
"""The built-in data sources."""

DATA_SOURCES: dict[str, type[Source]] = {"markov": MarkovCorpus, "clusters": ClustersCorpus}


def build_corpus(cfg: DataConfig) -> Source:
    """The corpus named by `cfg.kind`, built from the spec's data section."""
    if cfg.kind not in DATA_SOURCES:
        allowed = ", ".join(sorted(DATA_SOURCES))
        raise ConfigError(f"data.kind: unknown data source {cfg.kind!r}; allowed: {allowed}")
    return DATA_SOURCES[cfg.kind].from_config(cfg)


__all__ = [
    "DATA_SOURCES",
    "EVAL_START",
    "Batch",
    "ClustersCorpus",
    "Corpus",
    "DataCursor",
    "MarkovCorpus",
    "ShardedBatches",
    "Source",
    "build_corpus",
    "eval_batches",
]
