"""What the driver hears while a run goes on: rank 0's log records and the run's events
(each start attempt of the group, group starts, injected faults, failures the
controller saw) arrive through a small Ray queue actor; `RunFollower` turns them into
progress, MLflow metrics, restart counts and the recovery summary."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
import ray.train
import ray.train.torch
from ray.train.v2._internal.execution.callback import ControllerCallback
from ray.util.queue import Empty, Queue

from trainstack.observe.prometheus import RunTelemetry
from trainstack.observe.tracking import Tracker
from trainstack.runtime.progress import ProgressDisplay


class FailureWatch(ray.train.UserCallback):
    """Runs in the Train controller: tells the driver when it saw workers fail."""

    def __init__(self, events: Queue) -> None:
        self.events = events

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
        rank, error = next(iter(sorted(worker_exceptions.items())))
        said = last_line(error)
        with contextlib.suppress(Exception):
            self.events.put_nowait(
                {"event": "failure", "rank": rank, "error": said[:300], "time": time.time()}
            )


class StartAttemptWatch(ControllerCallback):
    """Runs in the Train controller: tells the driver each time it starts the worker group
    (the first start, a restart after a failure, a retry of a start that found no room
    within `scaling.start_timeout_s`) as a `start_attempt` event, which `on_record` sees."""

    def __init__(self, events: Queue) -> None:
        self.events = events

    def on_controller_start_worker_group(
        self, *, scaling_config: Any, num_workers: int
    ) -> dict[str, str] | None:
        with contextlib.suppress(Exception):
            self.events.put_nowait(
                {"event": "start_attempt", "workers": num_workers, "time": time.time()}
            )
        return None  # no label selector: the group is placed as the scaling config says


@dataclass(kw_only=True)
class RunFollower:
    """What the driver learns from the event queue while the run goes on."""

    display: ProgressDisplay | None
    tracker: Tracker
    on_record: Callable[[dict[str, Any]], None] | None = None
    telemetry: RunTelemetry | None = None
    starts: list[dict[str, Any]] = field(default_factory=list)
    faults: list[dict[str, Any]] = field(default_factory=list)
    """Injected kills, each with the `attempt` (index into `starts`) it ended."""
    failures: list[dict[str, Any]] = field(default_factory=list)
    """Failures the controller saw, each with its `attempt` and `after_step`."""
    resizes: list[dict[str, Any]] = field(default_factory=list)
    """Elastic resizes: the step the new group resumed from, its size before and after,
    and why (`workers lost` after a failure, else `room for more workers`)."""
    last_step: int = 0
    """The newest step the current attempt is known to have finished: its last logged
    step, its first step, or the step it resumed from."""

    def handle(self, record: dict[str, Any]) -> None:
        """One record from the queue: a log record (it has a "step" and no "event"), or
        an event handled by the `event_<name>` method of its name (others, such as
        `start_attempt`, only reach `on_record`)."""
        if self.on_record is not None:
            self.on_record(record)
        event = record.get("event")
        handler = self.log_record if event is None else getattr(self, f"event_{event}", None)
        if handler is not None:
            handler(record)

    def log_record(self, record: dict[str, Any]) -> None:
        self.last_step = record["step"]
        self.tracker.log_metrics({**record, "restarts": self.restarts}, step=record["step"])
        if self.display is not None:
            self.display.update({**record, "restarts": self.restarts})

    def event_start(self, record: dict[str, Any]) -> None:
        """A worker group started (the first, or a restart): the step it resumed from."""
        self.starts.append(record)
        self.last_step = record["resumed_from_step"]
        self._note_resize(record)
        if self.restarts and self.telemetry is not None:
            self.telemetry.record_restart("worker_group")
        if self.display is None:
            return
        if self.restarts:
            self.display.note(
                f"worker group restarted ({self.restarts}), resuming from step "
                f"{record['resumed_from_step']}"
            )
        elif record["resumed_from_step"]:
            self.display.note(f"resuming from step {record['resumed_from_step']}")
        for note in record.get("notes", []):
            self.display.note(note)

    def event_first_step(self, record: dict[str, Any]) -> None:
        self.last_step = record["step"]

    def event_fault(self, record: dict[str, Any]) -> None:
        """An injected kill: the step it ended is known exactly."""
        self.faults.append({**record, "attempt": self.attempt})

    def event_failure(self, record: dict[str, Any]) -> None:
        """Workers the controller saw fail (after the last step the driver heard of)."""
        self.failures.append({**record, "attempt": self.attempt, "after_step": self.last_step})
        if self.display is not None:
            self.display.note(f"worker {record['rank']} failed: {record['error']}")

    def event_compression(self, record: dict[str, Any]) -> None:
        """Adaptive compression changed its ratio."""
        self.tracker.log_metrics({"compression_topk_ratio": record["ratio"]}, step=record["step"])
        if self.display is not None:
            self.display.note(f"step {record['step']}: compression {record['reason']}")

    def _note_resize(self, start: dict[str, Any]) -> None:
        """Record a group that started at another size than the one before it."""
        if len(self.starts) < 2:
            return
        before, now = self.starts[-2].get("world_size"), start.get("world_size")
        if before is None or now is None or before == now:
            return
        lost = any(f["attempt"] == len(self.starts) - 2 for f in self.failures)
        resize = {
            "step": start["resumed_from_step"],
            "from": before,
            "to": now,
            "reason": "workers lost" if lost else "room for more workers",
        }
        self.resizes.append(resize)
        self.tracker.log_metrics({"world_size": now}, step=resize["step"])
        if self.display is not None:
            self.display.note(
                f"resized {before} → {now} workers at step {resize['step']} ({resize['reason']})"
            )

    @property
    def restarts(self) -> int:
        return max(0, len(self.starts) - 1)

    @property
    def attempt(self) -> int:
        """Index of the worker group now running (0 before the first start)."""
        return max(0, len(self.starts) - 1)

    def recovery(self) -> list[dict[str, Any]]:
        """Per restart: the step it resumed from, the last step finished before the
        failure, and the steps of work lost (None when no failure was seen).

        After an injected kill (`faults`) the failed step is known exactly; after any
        other failure (a process killed from outside, out of memory) it is the last
        step the driver heard of before the controller reported the failure (a log
        step, the attempt's first step, or the step it resumed from), so `steps_lost`
        is short by less than `log.every_steps` at most.
        """
        out = []
        for attempt, start in enumerate(self.starts[1:]):
            failed_at = self._failed_after(attempt)
            resumed = start["resumed_from_step"]
            out.append(
                {
                    "resumed_from_step": resumed,
                    "failed_after_step": failed_at,
                    "steps_lost": None if failed_at is None else max(0, failed_at - resumed),
                }
            )
        return out

    def _failed_after(self, attempt: int) -> int | None:
        """The last step worker group `attempt` finished before it failed."""
        for fault in self.faults:
            if fault["attempt"] == attempt:
                return int(fault["step"]) - 1
        for failure in self.failures:
            if failure["attempt"] == attempt:
                return int(failure["after_step"])
        return None


def last_line(error: BaseException) -> str:
    """The last line of `error`'s message (Ray's errors end with what went wrong), or its
    type's name when it has none."""
    return (str(error).strip().splitlines() or [type(error).__name__])[-1]


def drain(queue: Queue, follower: RunFollower, *, timeout: float) -> None:
    """Handle every record waiting in the queue (waiting up to `timeout` for the first)."""
    try:
        record = queue.get(timeout=timeout) if timeout else queue.get_nowait()
    except Empty:
        return
    while True:
        follower.handle(record)
        try:
            record = queue.get_nowait()
        except Empty:
            return
