"""Data sources (by the name `trainstack.kinds` gives each) and deterministic rank sharding.

Every source serves `(inputs, targets)` micro-batches by global sample index
(`sharding.Corpus`) and names its data by a `fingerprint`: synthetic `markov` token
windows (`task.kind: lm`) and `clusters` labelled inputs (`classify`); your files as
`tokens` (flat token files, lm), `chat` (conversations in jsonl, loss on the
assistant's tokens, lm) and `arrays` (.npz / .npy inputs and labels, classify); your
own map-style Dataset as `custom`. The file and Dataset sources are finite and read in
seeded epochs (`indexed.IndexedCorpus`). `ray` streams are built by `ray_source`
instead, and `text` by `text` from files `trainstack prepare` wrote.
"""

from __future__ import annotations

from typing import Protocol

from trainstack.config import ConfigError, DataConfig
from trainstack.data.arrays import ArrayCorpus
from trainstack.data.chat import ChatCorpus
from trainstack.data.clusters import ClustersCorpus
from trainstack.data.custom_dataset import DatasetCorpus
from trainstack.data.indexed import IndexedCorpus
from trainstack.data.markov import EVAL_START, MarkovCorpus
from trainstack.data.ray_source import RaySource
from trainstack.data.sharding import Batch, Corpus, DataCursor, ShardedBatches, eval_batches
from trainstack.data.text import TextCorpus
from trainstack.data.tokens import TokenCorpus
from trainstack.kinds import DATA_KINDS, load

Source = MarkovCorpus | ClustersCorpus | IndexedCorpus | TokenCorpus | ChatCorpus | RaySource
"""The built-in data sources: a corpus with a `fingerprint`."""


class SourceKind(Protocol):
    """A data source's class: it builds the corpus a spec's data section describes."""

    def from_config(self, cfg: DataConfig) -> Source: ...


DATA_SOURCES: dict[str, SourceKind] = {k.name: load(k.build) for k in DATA_KINDS.values()}
"""The data sources by `data.kind` (`trainstack.kinds` names them)."""


def build_corpus(cfg: DataConfig) -> Source:
    """The corpus named by `cfg.kind`, built from the spec's data section (file paths
    already absolute: `paths.resolve_data`)."""
    if cfg.kind not in DATA_SOURCES:
        allowed = ", ".join(sorted(DATA_SOURCES))
        raise ConfigError(f"data.kind: unknown data source {cfg.kind!r}; allowed: {allowed}")
    return DATA_SOURCES[cfg.kind].from_config(cfg)


__all__ = [
    "DATA_SOURCES",
    "EVAL_START",
    "ArrayCorpus",
    "Batch",
    "ChatCorpus",
    "ClustersCorpus",
    "Corpus",
    "DataCursor",
    "DatasetCorpus",
    "IndexedCorpus",
    "MarkovCorpus",
    "ShardedBatches",
    "Source",
    "SourceKind",
    "TextCorpus",
    "TokenCorpus",
    "build_corpus",
    "eval_batches",
]
