"""`ParameterServerShard`: one slice of the model's parameters and their optimizer.

A shard applies each push as it arrives (`async`, `ssp`) or averages the pushes of
one clock from every worker and applies them together (`bsp`). Its version counts
the updates it has applied; a push carries the version of the parameters its
gradient was computed from, and its staleness is the difference. The learning rate
of a push follows the job's schedule at the pushing worker's clock, optionally
divided by 1 + a·staleness (`staleness_lr_factor`; the shard keeps each update's factor,
which the summary reports as `ps.lr_factor_mean`); with `reject_beyond_bound` a push
staler than the bound is dropped and counted.

A push may carry the mean gradient of several worker steps (`members`, from a local
server: ps/local.py); a bsp round then waits for the steps of every worker, not for a
push from each. The shard counts, per worker, the steps whose gradients it has taken
in and the newest of them (`landed`): a pull answers with the clock up to which every
worker's gradients are in (`complete`), so a worker knows how far behind its own clock
the parameters it computes with are, end to end.

Every `checkpoint_every_updates` updates the shard saves its parameters, optimizer
state and version (atomically, with a sha256 beside it) and, restarted by Ray after a
crash, resumes from the newest file that verifies. Pushes that reach it while it
restarts are retried by Ray (the actor is created with task retries), not lost.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from trainstack.checkpoint import save_atomically
from trainstack.compression import ErrorFeedback, Payload, build_compressor
from trainstack.config import JobConfig, config_from_dict
from trainstack.faults import first_firing
from trainstack.files import file_sha256, write_text_atomically
from trainstack.models import build_model
from trainstack.observe.prometheus import ShardTelemetry
from trainstack.optim import build_optimizer, lr_multiplier, scaled_lr
from trainstack.ps.clock import ActorNames
from trainstack.ps.partition import ShardLayout

Push = np.ndarray | list[tuple[tuple[int, ...], list[np.ndarray]]]
"""A gradient on the wire: the shard's flat float32 gradient, or with compression one
(shape, payload parts) per parameter."""

Pulled = tuple[int, np.ndarray, int]
"""A shard's answer to a pull: its version, its parameters as one float32 array, and
`complete`, the clock up to which it holds every worker's gradients."""


def staleness_lr_factor(staleness: int, *, rule: str, alpha: float) -> float:
    """What a push's scheduled learning rate is multiplied by for its staleness (updates
    applied since its parameters were pulled): 1 under `strategy.staleness_lr: none`,
    1 / (1 + alpha·staleness) under `inverse`."""
    if rule == "inverse":
        return 1.0 / (1.0 + alpha * staleness)
    return 1.0


class ParameterServerShard:
    def __init__(
        self,
        *,
        index: int,
        layout: ShardLayout,
        spec: dict[str, Any],
        checkpoint_dir: str,
        names: ActorNames,
    ) -> None:
        self.cfg = cfg = config_from_dict(spec)
        self.index = index
        self.layout = layout
        self.workers = cfg.scaling.num_workers
        self.board: Any = names.find(names.board)
        board = self.board
        self.dir = Path(checkpoint_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        # The seed fixes the model's weights: build it and keep this shard's slice (passing
        # the slice in would put it in the object store, where a restart may not find it).
        model = build_model(cfg.model, vocab_size=cfg.data.vocab_size, seed=cfg.train.seed)
        initial = layout.unflatten(layout.flatten(dict(model.named_parameters())))
        self.params = nn.ParameterList(nn.Parameter(t) for t in initial.values())
        self.base_lr = scaled_lr(cfg.optim, data_parallel_size=self.workers)
        self.optimizer = build_optimizer(self.params, cfg.optim, lr=self.base_lr)
        self.version = 0
        self.pending: dict[int, list[tuple[torch.Tensor, list[tuple[int, int]]]]] = {}
        """bsp: each clock's pushes so far, with the worker steps each averages."""
        self.landed = [0] * self.workers
        """Per worker, its newest step (a count of steps) whose gradient this shard took in."""
        self.received = [0] * self.workers
        """Per worker, how many of its steps' gradients this shard took in."""
        self.staleness: list[int] = []
        self.lr_factors: list[float] = []
        """Each applied update's `staleness_lr_factor`."""
        self.rejected = 0
        self.bytes_received = 0
        self.bytes_sent = 0
        """Parameters sent to workers or local servers (not the driver's pulls)."""
        self.apply_s = 0.0
        self.compressors: dict[int, Any] = {}
        self.telemetry = ShardTelemetry.for_shard(cfg, index=index, run_dir=self.dir.parent)
        self.telemetry.record_actor_start("ps_shard")
        restored = self._restore()
        if restored is not None:
            board.shard_restored.remote(index, restored)

    # ---- wire ---------------------------------------------------------------------------

    def pull(self, *, by_driver: bool = False) -> Pulled:
        """This shard's version, its parameters as one float32 array, and the clock up to
        which it holds every worker's gradients."""
        flat = torch.cat([p.detach().reshape(-1) for p in self.params]).numpy()
        if not by_driver:
            self.bytes_sent += flat.nbytes
        return self.version, flat, min(self.landed)

    def push(
        self,
        sender: int,
        clock: int,
        pulled_version: int,
        grad: Push,
        *,
        pull: bool = False,
        sent_at: float | None = None,
        members: list[tuple[int, int]] | None = None,
    ) -> tuple[int, np.ndarray | None, int]:
        """Apply (or, under bsp, collect) the gradient of step `clock` from `sender` (a
        worker, or a local server sending the mean of its workers' steps `members`, as
        (worker, clock) pairs), computed from this shard's parameters at `pulled_version`;
        return the version now, with `pull` the parameters too (a push and the next pull
        in one round trip), and `complete`. `sent_at`, the sender's `time.time()` at
        sending, measures the shard's queue."""
        self._maybe_die()
        start = time.perf_counter()
        steps = members if members is not None else [(sender, clock)]
        flat = self._decode(sender, clock, grad)
        staleness = self.version - pulled_version
        self.staleness.append(staleness)
        if self.cfg.strategy.consistency == "bsp":
            waiting = self.pending.setdefault(clock, [])
            waiting.append((flat, steps))
            if sum(len(held) for _, held in waiting) == self.workers:
                self._apply(_round_mean(self.pending.pop(clock)), clock=clock, staleness=0)
                self._took_in([step for _, held in waiting for step in held])
        else:
            s = self.cfg.strategy
            if s.reject_beyond_bound and staleness > s.staleness_bound:
                self.rejected += 1
            else:
                self._apply(flat, clock=clock, staleness=staleness)
            self._took_in(steps)
        self.apply_s += time.perf_counter() - start
        self.telemetry.record_push(staleness=staleness, sent_at=sent_at)
        return self.pull() if pull else (self.version, None, min(self.landed))

    def _took_in(self, steps: list[tuple[int, int]]) -> None:
        for worker, clock in steps:
            self.landed[worker] = max(self.landed[worker], clock + 1)
            self.received[worker] += 1

    def _decode(self, worker: int, clock: int, grad: Push) -> torch.Tensor:
        if isinstance(grad, np.ndarray):
            self.bytes_received += grad.nbytes
            return torch.from_numpy(np.array(grad, dtype=np.float32, copy=True))
        compressor = self.compressors.get(worker)
        if compressor is None:
            seed = self.cfg.train.seed
            compressor = build_compressor(self.cfg.compression, seed=seed, rank=worker)
            self.compressors[worker] = compressor
        parts = []
        for i, (shape, arrays) in enumerate(grad):
            payload = Payload(torch.Size(shape), tuple(torch.from_numpy(a.copy()) for a in arrays))
            self.bytes_received += payload.nbytes
            decoded = compressor.decode(payload, step=clock, bucket_index=i)
            parts.append(decoded.reshape(-1))
        return torch.cat(parts)

    def _apply(self, flat: torch.Tensor, *, clock: int, staleness: int) -> None:
        s, o = self.cfg.strategy, self.cfg.optim
        factor = staleness_lr_factor(staleness, rule=s.staleness_lr, alpha=s.staleness_alpha)
        self.lr_factors.append(factor)
        lr = self.base_lr * lr_multiplier(clock, o, total_steps=self.cfg.train.steps) * factor
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        offset = 0
        for p in self.params:
            p.grad = flat[offset : offset + p.numel()].view_as(p)  # `flat` is this shard's own
            offset += p.numel()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        self.telemetry.record_update()
        if self.version % s.checkpoint_every_updates == 0:
            self._save()

    # ---- checkpoints --------------------------------------------------------------------

    def _path(self, version: int) -> Path:
        return self.dir / f"shard_{self.index:03d}_v{version:09d}.pt"

    def _save(self) -> None:
        state = {
            "version": self.version,
            "params": [p.detach().clone() for p in self.params],
            "optimizer": self.optimizer.state_dict(),
            "staleness": torch.tensor(self.staleness, dtype=torch.int64),
            "lr_factors": torch.tensor(self.lr_factors, dtype=torch.float64),
            "rejected": self.rejected,
            "landed": torch.tensor(self.landed, dtype=torch.int64),
            "received": torch.tensor(self.received, dtype=torch.int64),
        }
        path = self._path(self.version)
        save_atomically(state, path)
        write_text_atomically(path.with_suffix(".sha256"), file_sha256(path))
        for old in sorted(self.dir.glob(f"shard_{self.index:03d}_v*.pt"))[:-2]:
            old.unlink(missing_ok=True)
            old.with_suffix(".sha256").unlink(missing_ok=True)

    def _restore(self) -> int | None:
        """Load the newest checkpoint of this shard that verifies; return its version."""
        for path in sorted(self.dir.glob(f"shard_{self.index:03d}_v*.pt"), reverse=True):
            digest = path.with_suffix(".sha256")
            if not digest.exists() or digest.read_text().strip() != file_sha256(path):
                continue
            state = torch.load(path, map_location="cpu", weights_only=True)
            with torch.no_grad():
                for p, saved in zip(self.params, state["params"], strict=True):
                    p.copy_(saved)
            self.optimizer.load_state_dict(state["optimizer"])
            self.version = int(state["version"])
            self.staleness = state["staleness"].tolist()
            self.lr_factors = state["lr_factors"].tolist()
            self.rejected = int(state["rejected"])
            self.landed = state["landed"].tolist()
            self.received = state["received"].tolist()
            return self.version
        return None

    def _maybe_die(self) -> None:
        """Test-only: die just before applying a planned update, once per run."""
        f = self.cfg.faults
        upcoming = self.version + 1
        if self.index != f.shard or upcoming not in f.kill_shard_at_updates:
            return
        if first_firing(self.dir / f"killed_before_update_{upcoming}"):
            os._exit(17)

    def report(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "version": self.version,
            "staleness": self.staleness,
            "lr_factors": self.lr_factors,
            "rejected": self.rejected,
            "bytes_received": self.bytes_received,
            "bytes_sent": self.bytes_sent,
            "received": self.received,
            "apply_s": self.apply_s,
            "numel": self.layout.numel,
        }


def _round_mean(pushes: list[tuple[torch.Tensor, list[tuple[int, int]]]]) -> torch.Tensor:
    """A bsp round's gradient: the mean over every worker step, each push weighted by the
    steps it averages (with one step each: the plain mean of the pushes)."""
    if all(len(steps) == 1 for _, steps in pushes):
        return torch.stack([flat for flat, _ in pushes]).mean(0)
    total = sum(len(steps) for _, steps in pushes)
    return torch.stack([flat * len(steps) for flat, steps in pushes]).sum(0) / total


def push_codecs(cfg: JobConfig, *, shards: int, rank: int) -> tuple[list[Any], list[ErrorFeedback]]:
    """The compressor (None: dense) and error feedback of each shard's pushes, for the
    sender `rank` (a worker, or a local server after the workers), as `_decode` on the
    shard rebuilds them."""
    c = cfg.compression
    compressors = [
        build_compressor(c, seed=cfg.train.seed, rank=rank) if c.kind != "none" else None
        for _ in range(shards)
    ]
    return compressors, [ErrorFeedback(enabled=c.error_feedback) for _ in range(shards)]


def encode_push(
    grads: dict[str, torch.Tensor],
    layout: ShardLayout,
    *,
    compressor: Any,
    feedback: ErrorFeedback | None,
    clock: int,
) -> tuple[Push, int]:
    """A worker's gradient for one shard in wire form, and its bytes."""
    if compressor is None:
        flat = layout.flatten(grads)
        return flat, flat.nbytes
    out, nbytes = [], 0
    for i, name in enumerate(layout.names):
        assert feedback is not None
        payload = feedback.encode(compressor, grads[name], step=clock, bucket_index=i)
        out.append((tuple(payload.shape), [part.numpy() for part in payload.parts]))
        nbytes += payload.nbytes
    return out, nbytes
