"""What the driver hears while a run goes on: rank 0's log records and the run's events
(each start attempt of the group, group starts, injected faults, failures the
controller saw) arrive through a small Ray queue actor; `RunFollower` turns them into
progress, MLflow metrics, restart counts and the recovery summary."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import ray
import ray.train
import ray.train.torch
from ray.util.queue import Empty, Queue

from trainstack.compat.ray import start_attempt_callback
from trainstack.observe.prometheus import RunTelemetry
from trainstack.observe.tracking import Tracker
from trainstack.run_events import (
    CompressionChange,
    Failure,
    Fault,
    FirstStep,
    RunEvent,
    Start,
    StartAttempt,
    event_of,
)
from trainstack.runtime.progress import ProgressDisplay


class FailureWatch(ray.train.UserCallback):
    """Runs in the Train controller: tells the driver when it saw workers fail."""

    def __init__(self, events: Queue) -> None:
        self.events = events

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
        rank, error = next(iter(sorted(worker_exceptions.items())))
        said = last_line(error)
        with contextlib.suppress(Exception):
            self.events.put_nowait(Failure(rank=rank, error=said[:300]).to_record())


@dataclass(frozen=True)
class StartAttemptRecorder:
    """Runs in the Train controller: puts a `start_attempt` event on the queue for each
    start of the worker group."""

    events: Queue

    def __call__(self, workers: int) -> None:
        with contextlib.suppress(Exception):
            self.events.put_nowait(StartAttempt(workers=workers).to_record())


def controller_watches(events: Queue) -> list[Any]:
    """The callbacks the Train controller runs for the driver: `FailureWatch`, and where
    this Ray's controller has the hook (`compat.ray.start_attempt_callback`), one
    that tells the driver each time it starts the worker group (the first start, a
    restart after a failure, a retry of a start that found no room within
    `scaling.start_timeout_s`) as a `start_attempt` event, which `on_record` sees."""
    start_attempts = start_attempt_callback(StartAttemptRecorder(events))
    return [FailureWatch(events)] + ([start_attempts] if start_attempts is not None else [])


SPENT = ("time_steps_s", "time_eval_s", "time_checkpoint_s")
"""The seconds a worker group's log records and summary give, for goodput."""


@dataclass(kw_only=True)
class RunFollower:
    """What the driver learns from the event queue while the run goes on."""

    display: ProgressDisplay | None
    tracker: Tracker
    on_record: Callable[[dict[str, Any]], None] | None = None
    telemetry: RunTelemetry | None = None
    starts: list[Start] = field(default_factory=list)
    faults: list[tuple[int, Fault]] = field(default_factory=list)
    """Injected kills, each with the attempt (index into `starts`) it ended."""
    failures: list[tuple[int, int, Failure]] = field(default_factory=list)
    """Failures the controller saw, each with its attempt and the last step heard of
    before it."""
    resizes: list[dict[str, Any]] = field(default_factory=list)
    """Elastic resizes: the step the new group resumed from, its size before and after,
    and why (`workers lost` after a failure or when it shrank, else `room for more
    workers`)."""
    last_step: int = 0
    """The newest step the current attempt is known to have finished: its last logged
    step, its first step, or the step it resumed from."""
    first_steps: dict[int, FirstStep] = field(default_factory=dict)
    """Each worker group's first step, by attempt."""
    spent: dict[int, dict[str, Any]] = field(default_factory=dict)
    """Each worker group's seconds in steps, evaluation and checkpoint stalls as its last
    log record gave them (`time_*_s`, from the step of `step`), by attempt."""

    def handle(self, record: dict[str, Any]) -> None:
        """One record from the queue: a log record (it has a "step" and no "event"), or
        an event, handled by the method for its type (others, such as `StartAttempt`,
        only reach `on_record`)."""
        if self.on_record is not None:
            self.on_record(record)
        if "event" not in record:
            self.log_record(record)
            return
        event = event_of(record)
        handler = None if event is None else self._handlers.get(type(event))
        if handler is not None:
            handler(self, event)

    def log_record(self, record: dict[str, Any]) -> None:
        self.last_step = record["step"]
        if "time_steps_s" in record:
            self.spent[self.attempt] = {k: record[k] for k in (*SPENT, "step")}
        self.tracker.log_metrics({**record, "restarts": self.restarts}, step=record["step"])
        if self.display is not None:
            self.display.update({**record, "restarts": self.restarts})

    def on_start(self, event: Start) -> None:
        """A worker group started (the first, or a restart): the step it resumed from."""
        self.starts.append(event)
        self.last_step = event.resumed_from_step
        self._note_resize(event)
        if self.restarts and self.telemetry is not None:
            self.telemetry.record_restart("worker_group")
        if self.display is None:
            return
        if self.restarts:
            self.display.note(
                f"worker group restarted ({self.restarts}), resuming from step "
                f"{event.resumed_from_step}"
            )
        elif event.resumed_from_step:
            self.display.note(f"resuming from step {event.resumed_from_step}")
        for note in event.notes:
            self.display.note(note)

    def on_first_step(self, event: FirstStep) -> None:
        self.last_step = event.step
        self.first_steps.setdefault(self.attempt, event)

    def on_fault(self, event: Fault) -> None:
        """An injected kill: the step it ended is known exactly."""
        self.faults.append((self.attempt, event))

    def on_failure(self, event: Failure) -> None:
        """Workers the controller saw fail (after the last step the driver heard of)."""
        self.failures.append((self.attempt, self.last_step, event))
        if self.display is not None:
            self.display.note(f"worker {event.rank} failed: {event.error}")

    def on_compression(self, event: CompressionChange) -> None:
        """Adaptive compression changed its ratio."""
        self.tracker.log_metrics({"compression_topk_ratio": event.ratio}, step=event.step)
        if self.display is not None:
            self.display.note(f"step {event.step}: compression {event.reason}")

    _handlers: ClassVar[dict[type[RunEvent], Callable[[Any, Any], None]]] = {
        Start: on_start,
        FirstStep: on_first_step,
        Fault: on_fault,
        Failure: on_failure,
        CompressionChange: on_compression,
    }
    """The method for each event type; a type missing here only reaches `on_record`."""

    def _note_resize(self, start: Start) -> None:
        """Record a group that started at another size than the one before it."""
        if len(self.starts) < 2:
            return
        before, now = self.starts[-2].world_size, start.world_size
        if before == now:
            return
        # A group shrinks only when workers are gone; the controller's failure event may
        # also reach the queue after the new group's start (seen on a 3 -> 1 resize).
        failed = any(attempt == len(self.starts) - 2 for attempt, _, _ in self.failures)
        lost = failed or now < before
        step = start.resumed_from_step
        resize = {
            "step": step,
            "from": before,
            "to": now,
            "reason": "workers lost" if lost else "room for more workers",
        }
        self.resizes.append(resize)
        self.tracker.log_metrics({"world_size": now}, step=step)
        if self.display is not None:
            self.display.note(
                f"resized {before} → {now} workers at step {resize['step']} ({resize['reason']})"
            )

    @property
    def first_step(self) -> FirstStep | None:
        """The first step any worker group finished (start-up ends there)."""
        return next(iter(self.first_steps.values()), None)

    @property
    def restarts(self) -> int:
        return max(0, len(self.starts) - 1)

    @property
    def attempt(self) -> int:
        """Index of the worker group now running (0 before the first start)."""
        return max(0, len(self.starts) - 1)

    def startup(self, *, began: float, checked: float, connected: float) -> dict[str, float] | None:
        """Where the time to the first step went, in seconds. `began` (the run was asked
        for), `checked` (the driver's checks done: pre-flight, the plan) and `connected`
        (Ray answered, or started) are the driver's wall clock, the rest the first worker
        group's rank 0's: starting the worker group (tracking, placement, the workers'
        processes and imports), building the model and strategy (data, weights,
        restore), the first step (with any compilation). None until the first group has
        finished a step."""
        if not self.starts or self.first_step is None:
            return None
        start, first = self.starts[0], self.first_step
        return {
            "checks_s": checked - began,
            "ray_connect_s": connected - checked,
            "worker_group_start_s": start.worker_entered - connected,
            "model_build_s": start.time - start.worker_entered,
            "first_step_s": first.time - start.time,
            "to_first_step_s": first.time - began,
        }

    def goodput(self, *, began: float, ended: float, final: dict[str, Any]) -> dict[str, float]:
        """Where the run's wall time went, in seconds, and `goodput`: the share of it in
        training steps that count. `began` and `ended` are the driver's wall clock (the
        run asked for, its summary in hand), `final` the last worker group's summary.

        - start-up: to the first worker group's first step (checks, Ray, the group, the
          model, the first step and any compilation);
        - steps: the steps after each group's first, less the replayed ones;
        - checkpoint: the training thread's time on saves (the final save is in `other`);
        - evaluation: held-out evaluation, the final one included;
        - restarts: from each failure (the last the driver heard of the failed group)
          to the new group's first step;
        - replayed: steps done again after a restart (each at its group's mean step);
        - other: the rest (logging, the run's end, what a failed group did after the
          last record it sent).
        """
        spent = dict(self.spent)
        spent[self.attempt] = {k: final.get(k, 0.0) for k in SPENT}
        steps = sum(s["time_steps_s"] for s in spent.values())
        split = {
            "startup_s": (self.first_step.time if self.first_step else ended) - began,
            "checkpoint_s": sum(s["time_checkpoint_s"] for s in spent.values()),
            "eval_s": sum(s["time_eval_s"] for s in spent.values()),
            "restarts_s": 0.0,
            "replayed_s": 0.0,
        }
        for attempt, lost in enumerate(self.recovery()):
            end = self._end_of(attempt)
            first = self.first_steps.get(attempt + 1)
            if end is not None and first is not None:
                split["restarts_s"] += max(0.0, first.time - end[1])
            before = self.spent.get(attempt)
            if lost["steps_lost"] and before:
                done = before["step"] - self.starts[attempt].resumed_from_step - 1
                mean = before["time_steps_s"] / done if done > 0 else 0.0
                split["replayed_s"] += lost["steps_lost"] * mean
        wall = ended - began
        split["steps_s"] = max(0.0, steps - split["replayed_s"])
        split["other_s"] = wall - sum(split.values())
        return {"goodput": split["steps_s"] / wall if wall > 0 else 0.0, "wall_s": wall, **split}

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
            resumed = start.resumed_from_step
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
        ended = self._end_of(attempt)
        return None if ended is None else ended[0]

    def _end_of(self, attempt: int) -> tuple[int, float] | None:
        """How worker group `attempt` ended, as (the last step it finished, when it was
        seen to fail): its injected kill, else the controller's report; None if neither
        was seen."""
        for ended, fault in self.faults:
            if ended == attempt:
                return fault.step - 1, fault.time
        for ended, after_step, failure in self.failures:
            if ended == attempt:
                return after_step, failure.time
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
