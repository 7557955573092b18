"""Data sources (an explicit name -> class dict) and deterministic rank sharding."""

from __future__ import annotations

from trainstack.config import ConfigError, DataConfig
from trainstack.data.markov import EVAL_START, MarkovCorpus
from trainstack.data.sharding import Batch, Corpus, DataCursor, ShardedBatches, eval_batches

DATA_SOURCES: dict[str, type[MarkovCorpus]] = {"markov": MarkovCorpus}


def build_corpus(cfg: DataConfig) -> MarkovCorpus:
    """The corpus named by `cfg.kind`, built from the spec's data section."""
    if cfg.kind not in DATA_SOURCES:
        allowed = ", ".join(sorted(DATA_SOURCES))
        raise ConfigError(f"data.kind: unknown data source {cfg.kind!r}; allowed: {allowed}")
    return DATA_SOURCES[cfg.kind](
        vocab_size=cfg.vocab_size, order=cfg.order, concentration=cfg.concentration, seed=cfg.seed
    )


__all__ = [
    "DATA_SOURCES",
    "EVAL_START",
    "Batch",
    "Corpus",
    "DataCursor",
    "MarkovCorpus",
    "ShardedBatches",
    "build_corpus",
    "eval_batches",
]
