"""`data.kind: ray`: a parquet corpus streamed through Ray Train's dataset shards learns on
two workers; after a worker is killed the run resumes, the rows consumed are counted
once and no row is trained on twice in an epoch. Pre-flight reads parquet, JSON lines
and text without Ray and names what is wrong in one line; Ray Data reads the same rows,
and a user's factory gives the training and held-out datasets."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed as dist

from trainstack import checkpoint as ckpt
from trainstack.config import ConfigError, ModelConfig, config_from_dict
from trainstack.data import MarkovCorpus
from trainstack.data.ray_source import (
    RaySource,
    check_ray_source,
    decode_rows,
    ray_datasets,
)
from trainstack.data.ray_stream import ShardRows
from trainstack.models.gpt import GPT
from trainstack.runtime.launcher import run_job

VOCAB, BLOCK = 16, 16
HERE = Path(__file__).resolve().parent


def markov() -> MarkovCorpus:
    return MarkovCorpus(vocab_size=VOCAB, order=1, concentration=0.1, seed=1234)


def write_corpus(folder: Path, *, train_rows: int, val_rows: int, files: int) -> np.ndarray:
    """Distinct Markov windows of BLOCK + 1 tokens (no two share their inputs) as parquet
    files `train-*.parquet` and `val.parquet`; returns the training rows."""
    windows = markov().samples(0, 4 * (train_rows + val_rows), BLOCK).numpy()
    _, first = np.unique(windows[:, :-1], axis=0, return_index=True)
    windows = windows[np.sort(first)][: train_rows + val_rows]
    assert len(windows) == train_rows + val_rows
    folder.mkdir(parents=True, exist_ok=True)
    for i, part in enumerate(np.array_split(windows[:train_rows], files)):
        pq.write_table(pa.table({"tokens": list(part)}), folder / f"train-{i}.parquet")
    pq.write_table(pa.table({"tokens": list(windows[train_rows:])}), folder / "val.parquet")
    return windows[:train_rows]


def spec(folder: Path, **data: Any) -> dict[str, Any]:
    return {
        "model": {"kind": "gpt", "n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": BLOCK},
        "data": {
            "kind": "ray",
            "train": sorted(str(p) for p in folder.glob("train-*")),
            "val": sorted(str(p) for p in folder.glob("val*")),
            "vocab_size": VOCAB,
            "eval_samples": 64,
            **data,
        },
    }


class RowRecordingGPT(GPT):
    """The built-in GPT, appending every training input row it sees to a file of its own
    (named by rank, then start time), so the test sees which rows trained, in order."""

    def __init__(self, *, record_dir: str, **gpt: Any) -> None:
        super().__init__(ModelConfig(kind="gpt", **gpt), vocab_size=VOCAB)
        self.record_dir = Path(record_dir)
        self.record: Path | None = None

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if self.training and torch.is_grad_enabled():
            if self.record is None:
                rank = dist.get_rank() if dist.is_initialized() else 0
                self.record = self.record_dir / f"rank{rank}-{time.time_ns()}-{os.getpid()}.txt"
            with self.record.open("a") as f:
                f.writelines(" ".join(map(str, row)) + "\n" for row in idx.tolist())
        return super().forward(idx)


def test_parquet_corpus_learns_on_two_workers_and_a_kill_repeats_no_row(
    ray_cluster: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = write_corpus(tmp_path / "corpus", train_rows=400, val_rows=64, files=4)
    row_id = {" ".join(map(str, row[:-1])): i for i, row in enumerate(rows)}
    records = tmp_path / "records"
    records.mkdir()
    paths = [str(HERE), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths))  # workers import the model
    # 2 workers x 8 rows a step: a worker's 200-row shard is 25 steps, so 50 steps are two
    # epochs; killed before step 13, the run resumes from step 10.
    steps, every, kill_at, per_rank, epoch_steps = 50, 10, 13, 8, 25
    gpt = {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": BLOCK}
    cfg = {
        **spec(tmp_path / "corpus"),
        "name": "ray-source",
        "model": {
            "kind": "custom",
            "target": f"{__name__}:RowRecordingGPT",
            "args": {"record_dir": str(records), **gpt},
            "block_size": BLOCK,
        },
        "train": {"steps": steps, "global_batch_size": 16, "micro_batch_size": 4},
        "optim": {"warmup_steps": 5, "lr": 1e-2},
        "scaling": {"num_workers": 2},
        "checkpoint": {"storage_path": str(tmp_path / "runs"), "every_steps": every},
        "failure": {"max_failures": 1},
        "faults": {"kill_at_steps": [kill_at], "rank": 1},
        "tracking": {"backend": "none"},
        "log": {"every_steps": 10, "progress": "quiet"},
    }
    summary = run_job(config_from_dict(cfg))

    assert summary["world_size"] == 2 and summary["restarts"] == 1
    assert summary["resumed_from_step"] == every
    assert summary["rows_consumed"] == steps * 16  # counted once, not per worker or attempt
    final = ckpt.verify(Path(summary["final_checkpoint"]))
    assert final.samples_seen == final.manifest["data"]["rows_consumed"] == steps * 16
    assert final.manifest["data"]["epoch"] == 1
    floor = markov().loss_floor(BLOCK)
    assert summary["eval_loss"] < 0.6 * math.log(VOCAB)  # an untrained model: ln(vocab)
    assert summary["eval_loss"] < 1.25 * floor, (summary["eval_loss"], floor)

    first_epoch: list[int] = []
    for rank in (0, 1):
        runs = []
        for path in sorted(records.glob(f"rank{rank}-*.txt")):
            ids = [row_id.get(line.strip()) for line in path.read_text().splitlines()]
            runs.append([i for i in ids if i is not None])  # held-out probe rows aside
        before, after = [run for run in runs if run]
        kept = before[: every * per_rank]  # trained before the checkpoint resumed from
        assert after[: (kill_at - 1 - every) * per_rank] == before[len(kept) : len(kept) + 16]
        trained = kept + after  # the run as it counts: the replayed steps once
        assert len(trained) == steps * per_rank
        epochs = trained[: epoch_steps * per_rank], trained[epoch_steps * per_rank :]
        assert len(set(epochs[0])) == len(epochs[0])  # no row twice in an epoch ...
        assert set(epochs[1]) == set(epochs[0]) and epochs[1] != epochs[0]  # ... re-shuffled
        first_epoch += epochs[0]
    assert sorted(first_epoch) == list(range(len(rows)))  # the workers' shards: all rows, once


def write_lines(folder: Path, fmt: str, rows: np.ndarray, *, val_rows: int) -> Path:
    """`rows` as JSON lines (`{"tokens": [...]}`) or text lines (ids and spaces)."""
    text = [
        json.dumps({"tokens": r.tolist()}) if fmt == "json" else " ".join(map(str, r)) for r in rows
    ]
    folder.mkdir(parents=True)
    (folder / "train-0").write_text("\n".join(text) + "\n")
    (folder / "val").write_text("\n".join(text[:val_rows]) + "\n")
    return folder


def test_preflight_reads_parquet_json_and_text_and_names_what_is_wrong(tmp_path: Path) -> None:
    rows = write_corpus(tmp_path / "corpus", train_rows=8, val_rows=4, files=1)
    check_ray_source(config_from_dict(spec(tmp_path / "corpus", eval_samples=4)))
    for fmt in ("json", "text"):
        folder = write_lines(tmp_path / fmt, fmt, rows, val_rows=4)
        cfg = config_from_dict(spec(folder, format=fmt, eval_samples=4))
        check_ray_source(cfg)
        source = RaySource.from_config(cfg.data)
        x, y = source.held_out_batch(2, seq_len=BLOCK)
        assert x.tolist() == rows[:2, :-1].tolist() and y.tolist() == rows[:2, 1:].tolist()
        x, y = source.train_batch(3, 2, seq_len=BLOCK)  # pre-flight's probe: file order
        assert x.tolist() == rows[3:5, :-1].tolist() and y.tolist() == rows[3:5, 1:].tolist()

    def error(folder: Path, **data: Any) -> str:
        with pytest.raises(ConfigError) as e:
            check_ray_source(config_from_dict(spec(folder, **data)))
        assert "\n" not in str(e.value)
        return str(e.value)

    assert "no column data.column='ids'" in error(tmp_path / "corpus", column="ids")
    assert "held-out data holds 4 rows" in error(tmp_path / "corpus", eval_samples=5)
    assert "outside [0, data.vocab_size=8)" in error(tmp_path / "corpus", vocab_size=8)
    (tmp_path / "text" / "train-0").write_text("1 2 3\n")
    assert "each needs model.block_size + 1 = 17" in error(tmp_path / "text", format="text")


def test_shard_rows_start_each_epoch_anew_and_resume_at_a_recorded_position() -> None:
    shard = np.arange(30).reshape(10, 3)  # one worker's rows; odd epochs read it reversed

    def batches(epoch: int) -> Iterator[dict[str, np.ndarray]]:
        rows = shard if epoch % 2 == 0 else shard[::-1]
        return iter({"ids": rows[i : i + 4]} for i in range(0, len(rows), 4))

    def stream(**position: int) -> ShardRows:
        return ShardRows(batches=batches, decode=lambda batch: batch["ids"], **position)

    rows = stream()
    taken = np.concatenate([rows.take(6) for _ in range(4)])  # 24 rows: 2.4 epochs
    assert (taken == np.concatenate([shard, shard[::-1], shard[:4]])).all()
    assert (rows.epoch, rows.taken) == (2, 4)
    resumed = stream(epoch=rows.epoch)
    resumed.skip(rows.taken)  # what `RayStepBatches.for_worker` does with a checkpoint's
    assert (resumed.take(9) == rows.take(9)).all()
    assert (resumed.epoch, resumed.taken) == (rows.epoch, rows.taken) == (3, 3)


def parquet_factory(folder: str, split: bool = True) -> Any:
    """A user's `data.target`: the corpus read by Ray Data, with its held-out part or not."""
    import ray.data

    train = ray.data.read_parquet(sorted(str(p) for p in Path(folder).glob("train-*")))
    return (
        {"train": train, "val": ray.data.read_parquet(f"{folder}/val.parquet")} if split else train
    )


def test_json_text_and_factory_rows_come_through_ray_data(
    ray_cluster: None, tmp_path: Path
) -> None:
    rows = write_corpus(tmp_path / "corpus", train_rows=8, val_rows=4, files=1)

    def rows_of(dataset: Any, column: str) -> list[list[int]]:
        values = [v for b in dataset.iter_batches(batch_format="numpy") for v in b[column]]
        return decode_rows(values, width=BLOCK + 1, vocab=VOCAB).tolist()

    for fmt in ("json", "text"):
        folder = write_lines(tmp_path / fmt, fmt, rows, val_rows=4)
        datasets = ray_datasets(config_from_dict(spec(folder, format=fmt, eval_samples=4)))
        train = rows_of(datasets["train"], "tokens" if fmt == "json" else "text")
        assert sorted(train) == sorted(rows.tolist())

    corpus = str(tmp_path / "corpus")

    def from_factory(eval_samples: int, **args: Any) -> dict[str, Any]:
        data = {"kind": "ray", "target": f"{__name__}:parquet_factory", "args": args}
        spec = {"model": {"block_size": BLOCK}, "data": {**data, "eval_samples": eval_samples}}
        return ray_datasets(config_from_dict(spec))

    held_out = rows_of(from_factory(4, folder=corpus)["val"], "tokens")
    assert held_out == pq.read_table(f"{corpus}/val.parquet")["tokens"].to_pylist()
    for eval_samples, args, message in [
        (4, {"folder": corpus, "split": False}, "held-out data holds 0 rows"),
        (5, {"folder": corpus}, "held-out data holds 4 rows"),
        (4, {"folder": corpus, "oops": 1}, "raised TypeError"),
    ]:
        with pytest.raises(ConfigError, match=message):
            from_factory(eval_samples, **args)
