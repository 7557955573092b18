"""What a run tells its driver besides its metrics: one dataclass per event.

Workers, the Train controller's callbacks and the fault injector send each event as a
record, a plain dict (`to_record`: JSON lines for the gloo harness, the Ray queue,
`run_job(on_record=...)`), with its name under "event"; a log record is a dict with a
"step" and no "event". The driver reads a record back into its event (`event_of`) and
`runtime.events.RunFollower` handles each type in its own method. Pure Python, below
every layer that sends one.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True, kw_only=True)
class RunEvent:
    name: ClassVar[str]
    time: float = field(default_factory=time.time)
    """When it was sent (seconds since the epoch)."""

    def to_record(self) -> dict[str, Any]:
        return {"event": self.name, **dataclasses.asdict(self)}


@dataclass(frozen=True, kw_only=True)
class Start(RunEvent):
    """A worker group started (the first, or a restart) and restored its state."""

    name: ClassVar[str] = "start"
    resumed_from_step: int
    world_size: int
    notes: list[str] = field(default_factory=list)
    """What the run says once at start (layout, compiled blocks, a resized group)."""
    worker_entered: float = 0.0
    """When rank 0 entered the worker function (start-up time is `time` minus it)."""


@dataclass(frozen=True, kw_only=True)
class FirstStep(RunEvent):
    """The group's first step finished."""

    name: ClassVar[str] = "first_step"
    step: int


@dataclass(frozen=True, kw_only=True)
class Fault(RunEvent):
    """An injected kill (`faults:`): rank `rank` dies before `step`."""

    name: ClassVar[str] = "fault"
    step: int
    rank: int


@dataclass(frozen=True, kw_only=True)
class Failure(RunEvent):
    """The Train controller saw workers fail; the first rank's error, last line."""

    name: ClassVar[str] = "failure"
    rank: int
    error: str


@dataclass(frozen=True, kw_only=True)
class StartAttempt(RunEvent):
    """The Train controller starts a worker group (first start, restart or retry)."""

    name: ClassVar[str] = "start_attempt"
    workers: int


@dataclass(frozen=True, kw_only=True)
class CompressionChange(RunEvent):
    """Adaptive compression changed its top-k ratio after `step` (1.0: dense)."""

    name: ClassVar[str] = "compression"
    step: int
    ratio: float
    reason: str


EVENTS: dict[str, type[RunEvent]] = {
    cls.name: cls for cls in (Start, FirstStep, Fault, Failure, StartAttempt, CompressionChange)
}
"""Every event, by the name its record carries."""


def event_of(record: dict[str, Any]) -> RunEvent | None:
    """The event a record carries; None for a log record or an event of another name."""
    cls = EVENTS.get(record.get("event", ""))
    if cls is None:
        return None
    known = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in record.items() if k in known})
