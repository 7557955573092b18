"""`data.kind: ray`: rows of token ids from a Ray Data dataset, for corpora too big to index.

Each row is `model.block_size + 1` token ids: the inputs and, shifted by one, the
next-token targets (`data.column` of `parquet` or `json`-lines files or of the dataset
`data.target` returns; `text`: one row per line, the ids separated by spaces).

Pre-flight reads the first rows of every file without Ray (`check_ray_source`). Once Ray
is up, the driver builds the Trainer's datasets (`ray_datasets`): `train`, read with Ray
Data's readers (or returned by `data.target`), which Ray Train splits among the workers
(`get_dataset_shard`: an equal streaming split), and `val`, the first
`data.eval_samples` held-out rows, materialised once and given whole to every worker.
Workers read their shard through `ray_stream.RayStepBatches`.

Counting and resume. Every rank takes global_batch_size / world_size rows of its shard
per step, so the cursor (the manifest's `samples_seen`, the summary's `rows_consumed`)
counts steps x global_batch_size rows, once. `train` runs with `preserve_order`, the
file order is shuffled by `data.seed` and rows by a local buffer seeded by (seed, rank,
epoch), so each worker's stream repeats from run to run; on resume each worker reads
past (without training on) the rows it consumed in the checkpoint's epoch. At the same
worker count those are the rows it trained on before (a test checks it), as long as Ray
Data yields the same blocks again, which Ray does not promise: resume is not promised
bitwise, and a `target` dataset must be deterministic itself. At another worker count
the number of rows skipped is right, which rows they are is not. When a shard ends, the
next epoch starts on every worker (same file order, rows re-shuffled); the equal split
drops up to world_size - 1 rows of each epoch.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import islice
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from trainstack.config import ConfigError, DataConfig, JobConfig
from trainstack.data.sharding import Batch
from trainstack.user_code import call_target, import_target

if TYPE_CHECKING:
    import ray.data
    import ray.train

PEEK_ROWS = 4
"""Rows of each file pre-flight reads to check the column and the token ids."""


def check_ray_source(cfg: JobConfig) -> None:
    """Pre-flight on the driver, without Ray: `data.target` imports and is callable, or
    every file's first rows hold `model.block_size + 1` ids below `data.vocab_size`."""
    d = cfg.data
    if d.target:
        if not callable(import_target(d.target, key="data.target")):
            raise ConfigError(f"data.target={d.target!r} is not callable; allowed: a function")
        return
    for key, files in (("data.train", d.train), ("data.val", d.val)):
        for path in files:
            try:
                decode_rows(_peek(d, path), width=cfg.model.block_size + 1, vocab=d.vocab_size)
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ConfigError(f"{key}: {path}: {e}") from None
    _check_held_out(d, rows=len(_head(d, d.val, d.eval_samples)))


def ray_fingerprint(d: DataConfig) -> str:
    """Digest of the data: the files (paths and sizes), or `target` and `args`."""
    what: dict[str, Any] = {"format": d.format, "column": d.column}
    if d.target:
        what.update(target=d.target, args=d.args)
    else:
        for key, files in (("train", d.train), ("val", d.val)):
            what[key] = [[path, os.path.getsize(path)] for path in files]
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()


def ray_datasets(cfg: JobConfig) -> dict[str, ray.data.Dataset | Callable[[], ray.data.Dataset]]:
    """The Trainer's `datasets=`, built on the driver once Ray is up: `train`, streamed, and
    `val`, the first max(eval_samples, 1) held-out rows materialised here (without
    held-out data: one training row, for the workers' probe)."""
    import ray.data

    d, count = cfg.data, max(cfg.data.eval_samples, 1)
    if not d.target:  # few rows, counted by pre-flight: read directly, handed over in memory
        rows = [{row_column(d): v} for v in _head(d, d.val or d.train, count)]
        return {"train": _read(d), "val": ray.data.from_items(rows)}
    train, val = _call_factory(d)
    held_out = (val if val is not None else train).select_columns([d.column]).limit(count)
    held_out.context.execution_options.preserve_order = True
    materialised = held_out.materialize()
    _check_held_out(d, rows=materialised.count() if val is not None else 0)
    return {"train": train, "val": materialised}


def ray_ingest_config() -> ray.train.DataConfig:
    """Split `train` among the workers in a repeatable order; give each all of `val`."""
    import ray.train

    ordered = ray.train.DataConfig.default_ingest_options()
    ordered.preserve_order = True
    return ray.train.DataConfig(datasets_to_split=["train"], execution_options={"train": ordered})


@dataclass(kw_only=True)
class RaySource:
    """A `ray` source as a corpus: its fingerprint, its held-out rows, and the first
    training rows in file order for probes (training itself streams through
    `ray_stream.RayStepBatches`, in the stream's order)."""

    fingerprint: str
    vocab_size: int
    read_train: Callable[[int], Sequence[Any]] | None
    """The first n training rows of the files, undecoded; None for a `target`, whose rows
    only Ray Data reads: zeros of the right shape stand in (a shape probe)."""
    read_held_out: Callable[[int], Sequence[Any]] | None
    """The first n held-out rows (at least), undecoded; None as for `read_train`."""
    _rows: dict[str, np.ndarray] = field(default_factory=dict, repr=False)

    @classmethod
    def from_config(cls, d: DataConfig) -> RaySource:
        """On the driver (and the workers' training probe): files read directly."""
        return cls(
            fingerprint=ray_fingerprint(d),
            vocab_size=d.vocab_size,
            read_train=None if d.target else (lambda n: _head(d, d.train, n)),
            read_held_out=None if d.target else (lambda n: _head(d, d.val, n)),
        )

    @classmethod
    def from_shard(cls, d: DataConfig) -> RaySource:
        """On a Ray Train worker: held-out rows from its `val` dataset (all of it, on every
        rank: max(eval_samples, 1) rows, a training row when there is no held-out data)."""
        import ray.train

        shard, column = ray.train.get_dataset_shard("val"), row_column(d)

        def read(n: int) -> list[Any]:
            return [v for b in shard.iter_batches(batch_format="numpy") for v in b[column]]

        return replace(cls.from_config(d), read_held_out=read)

    def train_batch(self, start: int, count: int, *, seq_len: int) -> Batch:
        """Training rows start..start+count-1 in file order, as (inputs, targets)."""
        return next_token_batch(self._read("train", start + count, seq_len=seq_len)[start:])

    def held_out_batch(self, count: int, *, seq_len: int) -> Batch:
        """The first `count` held-out rows as (inputs, targets), int64 [count, seq_len]."""
        return next_token_batch(self._read("held_out", count, seq_len=seq_len))

    def loss_floor(self, seq_len: int) -> float | None:
        """Unknown for real data."""
        return None

    def epoch(self, samples_seen: int, *, seq_len: int) -> int:
        """0: a stream's epoch is not a function of the rows consumed; checkpoints record
        the stream's own (`RayStepBatches.position`)."""
        return 0

    def _read(self, which: str, n: int, *, seq_len: int) -> np.ndarray:
        rows = self._rows.get(which)
        if rows is None or len(rows) < n:
            read = self.read_train if which == "train" else self.read_held_out
            values = read(n) if read else np.zeros((n, seq_len + 1), np.int64)
            rows = self._rows[which] = decode_rows(values, width=seq_len + 1, vocab=self.vocab_size)
        assert len(rows) >= n, "pre-flight bounds data.eval_samples by the held-out rows"
        return rows[:n]


def next_token_batch(rows: np.ndarray) -> Batch:
    """Rows of block_size + 1 ids as (inputs, next-token targets), int64 [n, block_size]."""
    window = torch.from_numpy(np.ascontiguousarray(rows))
    return window[:, :-1].contiguous(), window[:, 1:].contiguous()


def decode_rows(values: Sequence[Any] | np.ndarray, *, width: int, vocab: int) -> np.ndarray:
    """Rows of token ids (sequences, or strings of space-separated ids) as int64 [n, width]."""
    rows = [np.asarray(v.split() if isinstance(v, str) else v) for v in values]
    bad = next((r for r in rows if r.shape != (width,) or r.dtype.kind not in "iuU"), None)
    if bad is not None:
        raise ValueError(
            f"a row holds {bad.size} {bad.dtype} values; each needs model.block_size + 1 = "
            f"{width} integer token ids"
        )
    out = np.stack(rows).astype(np.int64) if rows else np.empty((0, width), np.int64)
    if out.size and (out.min() < 0 or out.max() >= vocab):
        bad_id = out.min() if out.min() < 0 else out.max()
        raise ValueError(f"token id {bad_id} is outside [0, data.vocab_size={vocab})")
    return out


def row_column(d: DataConfig) -> str:
    """The column a row's ids are in: `data.column`, or Ray's `text` for text files."""
    return "text" if d.format == "text" and not d.target else d.column


def _peek(d: DataConfig, path: str, n: int = PEEK_ROWS) -> list[Any]:
    """The first `n` rows' token-id values of one file, read without Ray."""
    if d.format == "parquet":
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(path)
        if d.column not in pf.schema_arrow.names:
            raise KeyError(f"no column data.column={d.column!r}; it has {pf.schema_arrow.names}")
        first = next(pf.iter_batches(batch_size=n, columns=[d.column]), None)
        return first.column(0).to_pylist() if first is not None else []
    with open(path, encoding="utf-8") as f:
        lines = list(islice((line for line in f if line.strip()), n))
    if d.format == "text":
        return lines
    records = [json.loads(line) for line in lines]
    if any(d.column not in r for r in records):
        raise KeyError(f"a record has no data.column={d.column!r}")
    return [r[d.column] for r in records]


def _head(d: DataConfig, files: Sequence[str], n: int) -> list[Any]:
    """The first `n` rows' values of `files`, in order, read without Ray."""
    rows: list[Any] = []
    for path in files:
        rows += _peek(d, path, n - len(rows)) if len(rows) < n else []
    return rows


def _read(d: DataConfig) -> ray.data.Dataset:
    """`data.train` with Ray Data's reader for `data.format`, files in a seeded order."""
    import ray.data

    files = list(d.train)
    order = ray.data.FileShuffleConfig(seed=d.seed, reseed_after_execution=False)
    shuffle = order if d.shuffle else None
    if d.format == "text":
        return ray.data.read_text(files, shuffle=shuffle)
    read = ray.data.read_parquet if d.format == "parquet" else ray.data.read_json
    ds = read(files, file_extensions=None, shuffle=shuffle)  # every file named, any extension
    return ds.select_columns([d.column])


def _check_held_out(d: DataConfig, *, rows: int) -> None:
    """`data.eval_samples` is at most the held-out rows there are."""
    if d.eval_samples > rows:
        raise ConfigError(
            f"data.eval_samples={d.eval_samples} but the held-out data holds {rows} rows; "
            'set data.val (files), or return {"train": ..., "val": ...} from data.target, '
            "with enough rows; or lower data.eval_samples (0: no evaluation)"
        )


def _call_factory(d: DataConfig) -> tuple[ray.data.Dataset, ray.data.Dataset | None]:
    """`data.target(**data.args)`: a Dataset, or a mapping with `train` and optional `val`."""
    import ray.data

    made = call_target(
        d.target, d.args, key="data.target", args_key="data.args", makes="a ray.data.Dataset"
    )
    train, val = (made.get("train"), made.get("val")) if isinstance(made, Mapping) else (made, None)
    if not isinstance(train, ray.data.Dataset) or not isinstance(val, ray.data.Dataset | None):
        raise ConfigError(
            f"data.target={d.target!r} returned a {type(made).__name__}; allowed: a "
            'ray.data.Dataset, or a mapping {"train": Dataset, "val": Dataset}'
        )
    return train, val
