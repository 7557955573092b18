"""A `ray` source on a worker: its shard of `train` as each optimizer step's micro-batches.

`ShardRows` reads the worker's rows in order, epoch after epoch, and can skip rows;
`RayStepBatches` takes global_batch_size / world_size rows per step, counts the rows
consumed by all ranks (the cursor) and, on resume, skips the rows of the checkpoint's
epoch that were consumed. What that guarantees is in `ray_source`'s docstring.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from trainstack.config import JobConfig
from trainstack.data.ray_source import decode_rows, next_token_batch, row_column
from trainstack.data.sharding import Batch, DataCursor

if TYPE_CHECKING:
    from trainstack import checkpoint as ckpt
    from trainstack.strategies import WorkerContext

SHUFFLE_BUFFER_ROWS = 1024
"""Rows a worker's local shuffle buffer holds (with `data.shuffle`)."""


@dataclass(kw_only=True)
class ShardRows:
    """One worker's training rows, in order, epoch after epoch; `taken` counts the rows
    read in the current epoch (trained on or skipped)."""

    batches: Callable[[int], Iterator[Mapping[str, Any]]]
    """Epoch e's batches of this worker's shard."""
    decode: Callable[[Mapping[str, Any]], np.ndarray]
    """A batch's rows as int64 [n, block_size + 1]."""
    epoch: int = 0
    taken: int = 0
    _stream: Iterator[Mapping[str, Any]] | None = field(default=None, repr=False)
    _buffer: np.ndarray = field(default_factory=lambda: np.empty((0, 0), np.int64), repr=False)

    def take(self, n: int) -> np.ndarray:
        parts = []
        while n:
            parts.append(self._next(n))
            n -= len(parts[-1])
        return np.concatenate(parts)

    def skip(self, n: int) -> None:
        while n:
            n -= len(self._next(n))

    def _next(self, most: int) -> np.ndarray:
        while not len(self._buffer):
            if self._stream is None:
                self._stream = self.batches(self.epoch)
            batch = next(self._stream, None)
            if batch is not None:
                self._buffer = self.decode(batch)
            elif self.taken == 0:
                raise ValueError(
                    "data.train: this worker's shard is empty (fewer rows than workers)"
                )
            else:  # the shard is done: the next epoch starts on every worker
                self._stream, self.epoch, self.taken = None, self.epoch + 1, 0
        part, self._buffer = self._buffer[:most], self._buffer[most:]
        self.taken += len(part)
        return part


@dataclass(kw_only=True)
class RayStepBatches:
    """One rank's micro-batches of each optimizer step, read from its shard; the cursor
    counts the rows all ranks consumed. Pipeline ranks of one replica need the same rows:
    there every rank's rows are gathered and each replica takes its slice of them."""

    rows: ShardRows
    global_batch_size: int
    micro_batch_size: int
    world_size: int
    replica: int
    replicas: int
    device: torch.device
    cursor: DataCursor = field(default_factory=DataCursor)

    @classmethod
    def for_worker(
        cls, cfg: JobConfig, ctx: WorkerContext, *, restored: ckpt.Checkpoint | None
    ) -> RayStepBatches:
        """This worker's stream, past the rows consumed before `restored` (if any)."""
        import ray.train

        d, g, w = cfg.data, cfg.train.global_batch_size, ctx.world_size
        assert g % w == 0, "validation: data.kind=ray needs global_batch_size % num_workers == 0"
        shard = ray.train.get_dataset_shard("train")

        def batches(epoch: int) -> Iterator[Mapping[str, Any]]:
            seed = int(np.random.SeedSequence([d.seed, ctx.rank, epoch]).generate_state(1)[0])
            return iter(
                shard.iter_batches(
                    batch_size=g // w,
                    batch_format="numpy",
                    local_shuffle_buffer_size=SHUFFLE_BUFFER_ROWS if d.shuffle else None,
                    local_shuffle_seed=seed if d.shuffle else None,
                )
            )

        width, column = cfg.model.block_size + 1, row_column(d)
        rows = ShardRows(
            batches=batches,
            decode=lambda batch: decode_rows(batch[column], width=width, vocab=d.vocab_size),
        )
        position = restored.manifest.get("data", {}) if restored else {}
        rows.epoch = int(position.get("epoch", 0))
        rows.skip(int(position.get("epoch_rows", 0)) // w)
        return cls(
            rows=rows,
            global_batch_size=g,
            micro_batch_size=cfg.train.micro_batch_size,
            world_size=w,
            replica=cfg.data_parallel_rank(ctx.rank),
            replicas=cfg.data_parallel_size,
            device=ctx.device,
            cursor=DataCursor(samples_seen=restored.samples_seen if restored else 0),
        )

    def next_step(self) -> list[Batch]:
        """This rank's micro-batches for the next optimizer step, in accumulation order."""
        rows = self.rows.take(self.global_batch_size // self.world_size)
        replica, replicas = 0, 1
        if self.replicas < self.world_size:
            rows, replica, replicas = self._gathered(rows), self.replica, self.replicas
        b = self.micro_batch_size
        starts = range(replica * b, len(rows), replicas * b)
        self.cursor.samples_seen += self.global_batch_size
        return [next_token_batch(rows[s : s + b]) for s in starts]

    def position(self) -> dict[str, int]:
        """Where the stream is, for the checkpoint: rows consumed by all ranks, the epoch,
        and the rows of it read (by all ranks)."""
        return {
            "rows_consumed": self.cursor.samples_seen,
            "epoch": self.rows.epoch,
            "epoch_rows": self.rows.taken * self.world_size,
        }

    def _gathered(self, rows: np.ndarray) -> np.ndarray:
        """Every rank's rows, in rank order (a collective)."""
        mine = torch.from_numpy(rows).to(self.device)
        parts = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(parts, mine)
        return torch.cat(parts).cpu().numpy()
