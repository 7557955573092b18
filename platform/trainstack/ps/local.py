"""`LocalServer`: the lower level of a two-level parameter server.

With `strategy.local_servers` set, each worker pushes to and pulls from one local
server (one per node the workers landed on, `per_node`, or N of them, worker w with
server w mod N) instead of the global shards. A local server:

- sums its workers' pushes and sends the global shards their mean as one update:
  under `async` and `ssp` once `sync_every` worker steps are in (taking the shards'
  parameters back in the same round trip); under `bsp` once every one of its workers
  has pushed the clock, so a bsp round is still the mean over every worker's step and
  equals synchronous SGD;
- serves its workers the parameters it last took from the shards, and syncs first
  (sends what it holds, takes fresh parameters) when the worker pulling is more than
  `max_local_staleness` clocks past the clock they were taken at;
- with compression, compresses what it sends the shards (error feedback kept here): the
  bytes that cross to the shards are the ones that cost; its workers send it dense.

The end-to-end staleness a worker sees, in clocks: under `ssp` with bound s a worker
at clock c starts only once every worker has pushed c - s steps to its server; at most
`sync_every` - 1 of a server's steps wait there unsent, and its parameters were taken
at most `max_local_staleness` clocks back, so the parameters hold every worker's
gradients up to clock c - s - max_local_staleness - (sync_every - 1) (with
`pull_every` p, p - 1 clocks older still): `clock_lag_bound`.

A local server lives on its workers' node (`per_node`: pinned there) and is not
restarted: when it dies (its node lost), the worker steps it had summed but not sent
(at most `sync_every` - 1) are lost and counted (`ps.pushes_lost`), and its workers,
restarted by Ray wherever there is room, push to and pull from the global shards
directly for the rest of the run (`ps.workers_on_shards`).
"""

from __future__ import annotations

import time
from typing import Any, cast

import numpy as np
import ray

from trainstack.config import JobConfig, config_from_dict
from trainstack.ps.clock import ActorNames
from trainstack.ps.partition import ShardLayout
from trainstack.ps.shard import Pulled, encode_push, push_codecs


def clock_lag_bound(cfg: JobConfig) -> float:
    """The most clocks between a worker's step and the newest clock up to which its
    parameters hold every worker's gradients (`ps.clock_lag_max`), as the consistency
    mode and the local servers bound it (math.inf: async)."""
    s = cfg.strategy
    if s.consistency == "async":
        return float("inf")
    local = s.max_local_staleness + s.sync_every - 1 if s.local_servers != "none" else 0
    return float(s.staleness_bound * (s.consistency == "ssp") + (s.pull_every - 1) + local)


def worker_groups(cfg: JobConfig, worker_nodes: list[str]) -> list[list[int]]:
    """The workers of each local server: one server per node the workers are on (in
    the order the nodes first appear), or `local_servers` N servers, worker w with
    server w mod N."""
    text = cfg.strategy.local_servers
    if text == "per_node":
        nodes = list(dict.fromkeys(worker_nodes))
        return [[w for w, node in enumerate(worker_nodes) if node == n] for n in nodes]
    count = int(text)
    return [list(range(g, len(worker_nodes), count)) for g in range(count)]


class _Sum:
    """Worker steps summed and not yet sent: per shard a float32 sum, the oldest shard
    version they were computed from, and which (worker, clock) steps they are."""

    def __init__(self, shards: int) -> None:
        self.sums: list[np.ndarray | None] = [None] * shards
        self.versions: list[int] = []
        self.steps: list[tuple[int, int]] = []

    def add(self, worker: int, clock: int, versions: list[int], flats: list[np.ndarray]) -> None:
        for i, flat in enumerate(flats):
            total = self.sums[i]
            self.sums[i] = flat.astype(np.float32, copy=True) if total is None else total + flat
        self.versions = (
            list(versions) if not self.versions else list(map(min, self.versions, versions))
        )
        self.steps.append((worker, clock))


class LocalServer:
    def __init__(
        self,
        *,
        index: int,
        spec: dict[str, Any],
        layouts: list[ShardLayout],
        names: ActorNames,
        workers: list[int],
    ) -> None:
        self.cfg = cfg = config_from_dict(spec)
        self.index = index
        self.sender = cfg.scaling.num_workers + index
        """Its id on the shards' wire (compressors are kept per sender): after the workers'."""
        self.layouts = layouts
        self.workers = workers
        self.shards: list[Any] = [names.find(names.shard(i)) for i in range(len(layouts))]
        self.compressors, self.feedback = push_codecs(cfg, shards=len(layouts), rank=self.sender)
        self.waiting = _Sum(len(layouts))
        """async, ssp: the worker steps summed since the last send."""
        self.rounds: dict[int, _Sum] = {}
        """bsp: each clock's steps so far."""
        self.cache: list[Pulled] = []
        self.cache_clock = 0
        """The clock the cached parameters were taken at (a worker of this server's clock)."""
        self.syncs = 0
        self.bytes_sent = 0
        self.dense_bytes = 0
        self.cache = self._pull_shards()

    def pull(self, clock: int) -> list[Pulled]:
        """The parameters for a worker at `clock`: the cached ones, unless they were taken
        more than `max_local_staleness` clocks before it (then sync first)."""
        if clock - self.cache_clock > self.cfg.strategy.max_local_staleness:
            self._sync(clock)
        return self.cache

    def push(
        self, worker: int, clock: int, versions: list[int], flats: list[np.ndarray]
    ) -> list[int]:
        """Take `worker`'s dense gradient of step `clock` (one flat array per shard,
        computed from shard versions `versions`); send when the rule says; return the
        shard versions this server knows of now."""
        if self.cfg.strategy.consistency == "bsp":
            held = self.rounds.setdefault(clock, _Sum(len(self.layouts)))
            held.add(worker, clock, versions, flats)
            if len(held.steps) == len(self.workers):
                self._send(self.rounds.pop(clock), clock=clock, take=False)
        else:
            self.waiting.add(worker, clock, versions, flats)
            if len(self.waiting.steps) >= self.cfg.strategy.sync_every:
                self._sync(clock)
        return [version for version, _, _ in self.cache]

    def flush(self) -> None:
        """Send what is held (the run's end)."""
        if self.waiting.steps:
            self._sync(max(c for _, c in self.waiting.steps))

    def _sync(self, clock: int) -> None:
        """Send the steps summed since the last sync (if any) and take the shards'
        parameters, as those of a worker at `clock`."""
        if self.waiting.steps:
            self._send(self.waiting, clock=clock, take=True)
            self.waiting = _Sum(len(self.layouts))
        else:
            self.cache = self._pull_shards()
        self.cache_clock = max(self.cache_clock, clock)

    def _pull_shards(self) -> list[Pulled]:
        return cast(list[Pulled], ray.get([shard.pull.remote() for shard in self.shards]))

    def _send(self, held: _Sum, *, clock: int, take: bool) -> None:
        """Send the mean of `held`'s steps to every shard as one update; with `take`, keep
        the parameters they answer with."""
        count = len(held.steps)
        refs = []
        for i, (shard, layout) in enumerate(zip(self.shards, self.layouts, strict=True)):
            total = held.sums[i]
            assert total is not None
            mean = total / np.float32(count)
            if self.compressors[i] is None:
                wire: Any = mean
                nbytes = mean.nbytes
            else:
                wire, nbytes = encode_push(
                    layout.unflatten(mean),
                    layout,
                    compressor=self.compressors[i],
                    feedback=self.feedback[i],
                    clock=clock,
                )
            self.bytes_sent += nbytes
            self.dense_bytes += mean.nbytes
            refs.append(
                shard.push.remote(
                    self.sender,
                    clock,
                    held.versions[i],
                    wire,
                    pull=take,
                    sent_at=time.time(),
                    members=held.steps,
                )
            )
        answers = ray.get(refs)
        self.syncs += 1
        if take:
            self.cache = answers

    def report(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "workers": self.workers,
            "syncs": self.syncs,
            "bytes_sent": self.bytes_sent,
            "dense_bytes": self.dense_bytes,
        }
