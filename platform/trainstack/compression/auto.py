"""`compression.kind: auto`: top-k whose ratio (or dense) follows the network.

The ranks measure, and all decide the same from all-reduced figures:

- the link: every `probe_every` steps they time all-reduces of the dense gradient's
  size, a tenth and a hundredth of it, and fit the α-β model t = 2(N-1)α +
  2(N-1)/N · bytes/β by least squares;
- each step: its wall time, the hook's codec seconds and the loss (one 3-number
  all-reduce).

The modelled step time of a candidate ratio r (1 = dense) is compute + codec(r) +
comm(r): compute is the measured step time less the modelled communication of the
current ratio, codec(r) the latest measured codec seconds of a compressed step (0
dense), comm(r) the fitted ring all-reduce of the dense parts plus the all-gather of
the top-k parts (`cost.modelled_comm_seconds`). The controller moves to the fastest
candidate when it is modelled at least `margin` faster than the current one. A move
to a sparser ratio is guarded: if within `guard_steps` the loss's moving average rises
more than `drift` above its level at the move, it goes back, and ratios sparser than
the one restored are barred for a back-off that doubles each time. Every move is a
`Decision` with a one-line reason, which the run logs as an event and in MLflow.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from trainstack.compression.cost import modelled_comm_seconds
from trainstack.run_events import CompressionChange

CANDIDATES = (1.0, 0.1, 0.01, 0.001)
"""Ratios auto chooses among (1: dense), down to `compression.ratio`."""
ASSUMED_LATENCY_S = 10e-6
"""α of a link given by bandwidth alone (`compression.auto_link_gbit`)."""


@dataclass(frozen=True)
class LinkFit:
    """The α-β model of the link, from timed all-reduces."""

    latency_s: float
    bytes_per_s: float

    @classmethod
    def from_timings(cls, timings: list[tuple[int, float]], *, world_size: int) -> LinkFit:
        """Least squares of t = a + c·bytes over (bytes, seconds) all-reduce timings;
        α = a / 2(N-1), β = 2(N-1) / (N c); a >= 0 and c > 0 enforced."""
        n = len(timings)
        mean_b = sum(b for b, _ in timings) / n
        mean_t = sum(t for _, t in timings) / n
        var = sum((b - mean_b) ** 2 for b, _ in timings)
        slope = sum((b - mean_b) * (t - mean_t) for b, t in timings) / var if var else 0.0
        slope = max(slope, 1e-15)
        intercept = max(mean_t - slope * mean_b, 0.0)
        hops = 2 * (world_size - 1)
        return cls(latency_s=intercept / hops, bytes_per_s=hops / (world_size * slope))

    def seconds(self, *, reduced: int, gathered: int, world_size: int) -> float:
        """Modelled seconds of an all-reduce of `reduced` bytes and an all-gather of
        `gathered` bytes from each rank (none: 0 s)."""
        gbit = self.bytes_per_s * 8 / 1e9
        total = 0.0
        for kind, size in (("all_reduce", reduced), ("all_gather", gathered)):
            if size:
                total += modelled_comm_seconds(
                    kind=kind,  # type: ignore[arg-type]
                    bytes_per_rank=size,
                    world_size=world_size,
                    bandwidth_gbit=gbit,
                    latency_s=self.latency_s,
                )
        return total

    def describe(self) -> str:
        return f"link {self.bytes_per_s / 1e9:.3g} GB/s, {1e6 * self.latency_s:.0f} µs"


@dataclass(frozen=True)
class Decision:
    step: int
    ratio: float
    """The ratio from the next step on (1.0: dense)."""
    reason: str

    def event(self) -> CompressionChange:
        return CompressionChange(step=self.step, ratio=self.ratio, reason=self.reason)


@dataclass
class ControllerState:
    ratio: float = 1.0
    previous: float = 1.0
    """The ratio before the last move to a sparser one."""
    link: tuple[float, float] | None = None
    step_s: float | None = None
    """Moving average of the step time at the current ratio."""
    codec_s: float = 0.0
    """Latest moving average of codec seconds while compressing."""
    loss: float | None = None
    """Moving average of the loss."""
    switch_step: int = -1
    switch_loss: float | None = None
    """The loss average when the current (sparser) ratio was taken, while guarded."""
    floor: float = 0.0
    """The sparsest ratio allowed until `barred_until`."""
    barred_until: int = -1
    backoff: int = 0


def _ema(old: float | None, new: float, keep: float) -> float:
    return new if old is None else keep * old + (1 - keep) * new


class AdaptiveRatio:
    """The policy: which ratio next, from measured step, codec and link figures."""

    def __init__(
        self,
        *,
        candidates: tuple[float, ...],
        comm_bytes: Callable[[float], tuple[int, int]],
        world_size: int,
        probe_every: int = 100,
        decide_every: int = 10,
        margin: float = 0.05,
        drift: float = 0.02,
        guard_steps: int = 100,
        assumed_link: LinkFit | None = None,
    ) -> None:
        self.candidates = candidates
        self.comm_bytes = comm_bytes
        """(all-reduced, all-gathered) bytes per rank per step at a ratio."""
        self.world_size = world_size
        self.probe_every = probe_every
        self.decide_every = decide_every
        self.margin = margin
        self.drift = drift
        self.guard_steps = guard_steps
        self.assumed_link = assumed_link
        """A link given by the spec (`compression.auto_link_gbit`): no probes."""
        self.state = ControllerState()
        if assumed_link is not None:
            self.state.link = (assumed_link.latency_s, assumed_link.bytes_per_s)

    @property
    def ratio(self) -> float:
        return self.state.ratio

    def link_figures(self) -> dict[str, Any] | None:
        """The link the controller models, for the run's summary: its bandwidth and
        latency, and whether they were measured (timed all-reduces) or given by the spec
        (`compression.auto_link_gbit`); None before the first probe."""
        link = self._link()
        if link is None:
            return None
        return {
            "bytes_per_s": link.bytes_per_s,
            "latency_s": link.latency_s,
            "measured": self.assumed_link is None,
            "description": link.describe(),
        }

    def wants_probe(self, step: int) -> bool:
        """Time the link after `step` (steps counted from 1)?"""
        if self.assumed_link is not None:
            return False
        return step == 5 or (step > 5 and step % self.probe_every == 0)

    def observe_link(self, timings: list[tuple[int, float]]) -> None:
        fit = LinkFit.from_timings(timings, world_size=self.world_size)
        self.state.link = (fit.latency_s, fit.bytes_per_s)

    def modelled_step_s(self) -> dict[float, float]:
        """Modelled seconds per step of each allowed candidate ({} before measuring)."""
        s, link = self.state, self._link()
        if link is None or s.step_s is None:
            return {}
        compute = max(0.0, s.step_s - self._comm_s(link, s.ratio) - self._codec_s(s.ratio))
        return {
            r: compute + self._codec_s(r) + self._comm_s(link, r)
            for r in self.candidates
            if r >= s.floor
        }

    def observe_step(
        self, step: int, *, step_s: float, codec_s: float, loss: float
    ) -> Decision | None:
        """Take one step's figures (after step `step`, counted from 1); a Decision when
        the ratio changes."""
        s = self.state
        s.step_s = _ema(s.step_s, step_s, 0.8)
        if s.ratio < 1.0:
            s.codec_s = _ema(s.codec_s or None, codec_s, 0.8)
        s.loss = _ema(s.loss, loss, 0.95)
        if step >= s.barred_until:
            s.floor = 0.0
        reverted = self._guard(step)
        if reverted is not None:
            return reverted
        if step % self.decide_every:
            return None
        return self._choose(step)

    def _guard(self, step: int) -> Decision | None:
        s = self.state
        if s.switch_loss is None or s.loss is None:
            return None
        if step - s.switch_step > self.guard_steps:
            s.switch_loss = None  # held for the whole guard: accepted
            return None
        rise = s.loss / s.switch_loss - 1
        if rise <= self.drift:
            return None
        s.backoff = max(2 * s.backoff, self.guard_steps)
        s.floor, s.barred_until = s.previous, step + s.backoff
        s.switch_loss = None
        return self._move(
            step,
            s.previous,
            f"back to {_shown(s.previous)}: loss average {100 * rise:.1f}% above its level "
            f"at the switch (guard {100 * self.drift:g}%); sparser barred for {s.backoff} steps",
        )

    def _choose(self, step: int) -> Decision | None:
        s, link = self.state, self._link()
        modelled = self.modelled_step_s()
        if link is None or not modelled:
            return None
        best = min(modelled, key=lambda r: (modelled[r], -r))
        current = modelled.get(s.ratio, float("inf"))
        if best == s.ratio or modelled[best] > (1 - self.margin) * current:
            return None
        if best < s.ratio:
            s.previous, s.switch_step, s.switch_loss = s.ratio, step, s.loss
        else:
            s.switch_loss = None
        return self._move(
            step,
            best,
            f"{_shown(best)}: modelled step {1e3 * modelled[best]:.3g} ms vs "
            f"{1e3 * current:.3g} ms at {_shown(s.ratio)} ({link.describe()})",
        )

    def _move(self, step: int, ratio: float, reason: str) -> Decision:
        self.state.ratio = ratio
        self.state.step_s = None  # a new ratio's step time is measured afresh
        return Decision(step=step, ratio=ratio, reason=reason)

    def _link(self) -> LinkFit | None:
        link = self.state.link
        return None if link is None else LinkFit(latency_s=link[0], bytes_per_s=link[1])

    def _comm_s(self, link: LinkFit, ratio: float) -> float:
        reduced, gathered = self.comm_bytes(ratio)
        return link.seconds(reduced=reduced, gathered=gathered, world_size=self.world_size)

    def _codec_s(self, ratio: float) -> float:
        return 0.0 if ratio >= 1.0 else self.state.codec_s

    def state_dict(self) -> dict[str, Any]:
        return asdict(self.state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        link = state.get("link")
        self.state = ControllerState(**{**state, "link": tuple(link) if link else None})


def _shown(ratio: float) -> str:
    return "dense" if ratio >= 1.0 else f"top-k {ratio:g}"


def time_all_reduces(
    sizes: list[int], *, group: dist.ProcessGroup, device: torch.device, repeats: int = 3
) -> list[tuple[int, float]]:
    """(bytes, seconds) of fp32 all-reduces of each size: the fastest of `repeats`, the
    slowest rank's (so every rank gets the same figures)."""
    seconds = []
    for size in sizes:
        buffer = torch.zeros(max(1, size // 4), device=device)
        dist.all_reduce(buffer, group=group)  # warm the path
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            dist.all_reduce(buffer, group=group)
            best = min(best, time.perf_counter() - start)
        seconds.append(best)
    slowest = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return [(size, float(t)) for size, t in zip(sizes, slowest.tolist(), strict=True)]
