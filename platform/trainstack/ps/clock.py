"""Worker clocks and the bounded-staleness rule, as plain state (tested without Ray).

A worker's clock is the number of steps it has pushed. Under `ssp` with bound s a
worker may start step c (its clock is c) only while c - min(clocks) <= s, where the
minimum runs over workers that have not finished; `bsp` is the bound 0; `async`
never waits. `ClockBoard` also remembers every worker's clock across its restarts
(the data cursor it resumes from), the largest shard version each shard reported,
and what each shard failure lost.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any


@dataclass(kw_only=True)
class StalenessBound:
    """Which workers may start which step: the SSP rule over their clocks."""

    workers: int
    bound: float
    """Clocks a worker may run ahead of the slowest (math.inf: async)."""
    total_steps: int
    clocks: list[int] = field(default_factory=list)
    stopped: set[int] = field(default_factory=set)
    """Workers that stopped early (a time budget): they hold no one back."""

    def __post_init__(self) -> None:
        if not self.clocks:
            self.clocks = [0] * self.workers

    def slowest(self) -> int:
        """The smallest clock of a worker that has steps left (total_steps if none has)."""
        running = [
            c for w, c in enumerate(self.clocks) if c < self.total_steps and w not in self.stopped
        ]
        return min(running, default=self.total_steps)

    def may_start(self, worker: int) -> bool:
        """May `worker` start its next step (its clock) now?"""
        return self.clocks[worker] - self.slowest() <= self.bound

    def gap(self, worker: int) -> int:
        """How many clocks `worker` is ahead of the slowest."""
        return self.clocks[worker] - self.slowest()

    def advance(self, worker: int, clock: int) -> None:
        """`worker` has pushed `clock` steps."""
        self.clocks[worker] = max(self.clocks[worker], clock)


@dataclass(frozen=True, kw_only=True)
class ActorNames:
    """The Ray names of one run's clock board, shards, workers and local servers: what the Ray
    dashboard's Actors page lists them as (`trainstack-ps-<run name>-<id>-shard-0`)."""

    prefix: str

    @property
    def board(self) -> str:
        return f"{self.prefix}-board"

    def shard(self, index: int) -> str:
        return f"{self.prefix}-shard-{index}"

    def worker(self, index: int) -> str:
        return f"{self.prefix}-worker-{index}"

    def local(self, index: int) -> str:
        return f"{self.prefix}-local-{index}"

    @staticmethod
    def find(name: str) -> Any:
        """The live actor of that name (after a restart too)."""
        import ray

        return ray.get_actor(name)


def bound_for(consistency: str, staleness_bound: int) -> float:
    return {"async": math.inf, "ssp": float(staleness_bound), "bsp": 0.0}[consistency]


class ClockBoard:
    """The Ray actor (async: waiting workers do not block the others) that holds the
    clocks, makes `ssp` workers wait, and keeps what the driver reports."""

    def __init__(self, *, workers: int, bound: float, total_steps: int) -> None:
        self.rule = StalenessBound(workers=workers, bound=bound, total_steps=total_steps)
        self.changed = asyncio.Condition()
        self.gap_max = 0
        self.waits = 0
        self.wait_s = 0.0
        self.recent_losses: deque[float] = deque(maxlen=16)
        self.shard_versions: dict[int, int] = {}
        self.shard_losses: list[dict[str, int]] = []
        self.worker_starts = [0] * workers
        self.on_shards: set[int] = set()
        """Workers whose local server was lost: they push to the shards directly."""

    async def wait_turn(self, worker: int, clock: int) -> int:
        """Block while `worker` may not start step `clock` (having pushed `clock` steps);
        return its clock gap then.

        The clock comes with the call: an async actor need not run a caller's calls in the
        order they were sent, so this must not rely on that worker's `advance` having run
        first (else a bsp worker could pull parameters before the others' pushes of the
        step it just finished had been applied)."""
        start = time.perf_counter()
        waited = False
        async with self.changed:
            if clock > self.rule.clocks[worker]:
                self.rule.advance(worker, clock)
                self.changed.notify_all()
            while not self.rule.may_start(worker):
                waited = True
                await self.changed.wait()
        if waited:
            self.waits += 1
            self.wait_s += time.perf_counter() - start
        gap = self.rule.gap(worker)
        self.gap_max = max(self.gap_max, gap)
        return gap

    async def advance(self, worker: int, clock: int, loss: float, versions: list[int]) -> None:
        """`worker` pushed step `clock` - 1 with mean loss `loss`; the shards answered
        with `versions`."""
        async with self.changed:
            self.rule.advance(worker, clock)
            self.recent_losses.append(loss)
            for shard, version in enumerate(versions):
                self.shard_versions[shard] = max(self.shard_versions.get(shard, 0), version)
            self.changed.notify_all()

    async def stop(self, worker: int) -> None:
        """`worker` takes no more steps (done, or out of time)."""
        async with self.changed:
            self.rule.stopped.add(worker)
            self.changed.notify_all()

    def worker_started(self, worker: int) -> int:
        """A worker (re)starts: count it and return the clock it resumes from."""
        self.worker_starts[worker] += 1
        return self.rule.clocks[worker]

    def fell_back(self, worker: int) -> None:
        """`worker`'s local server is gone: it pushes to the shards from now on."""
        self.on_shards.add(worker)

    def shard_restored(self, shard: int, version: int) -> None:
        """A restarted shard resumed from `version`: what it had applied beyond is lost."""
        seen = self.shard_versions.get(shard, 0)
        self.shard_losses.append(
            {"shard": shard, "restored_version": version, "updates_lost": max(0, seen - version)}
        )
        self.shard_versions[shard] = version

    def progress(self) -> dict[str, object]:
        return {
            "clocks": list(self.rule.clocks),
            "recent_loss": list(self.recent_losses),
        }

    def report(self) -> dict[str, object]:
        return {
            "clocks": list(self.rule.clocks),
            "gap_max": self.gap_max,
            "waits": self.waits,
            "wait_s": self.wait_s,
            "worker_restarts": [max(0, n - 1) for n in self.worker_starts],
            "workers_on_shards": sorted(self.on_shards),
            "shard_losses": self.shard_losses,
        }
