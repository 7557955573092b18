"""Runs a job on Ray: a synchronous strategy on a Ray Train V2 worker group, and a
`strategy.kind: ps` job on plain Ray actors (handed to `trainstack.ps.driver`).

The driver connects to Ray (an address, else an embedded local instance), picks the
checkpoint to start from, starts a `TorchTrainer` with one actor per worker, and
follows the run through a small Ray queue actor: rank 0's log records and the run's
events (each start attempt of the group, group starts, injected faults, failures the
controller saw). The driver renders progress, talks to MLflow and counts restarts; it
lives across worker-group restarts, so one job is one MLflow run however often its
workers die.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import ray.train
import ray.train.torch
from ray.train.torch import TorchTrainer
from ray.train.v2._internal.execution.callback import ControllerCallback
from ray.util.queue import Empty, Queue
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from trainstack import checkpoint as ckpt
from trainstack.config import ConfigError, JobConfig, config_from_dict, config_to_dict
from trainstack.data.ray_source import ray_datasets, ray_ingest_config
from trainstack.planner.choose import check_layout_fits, resolve_auto
from trainstack.runtime.capacity import (
    attempt_timeout_s,
    check_fits_this_machine,
    cluster_wait_note,
    is_start_timeout,
    start_timeout_message,
    worker_group_start_timeout,
)
from trainstack.runtime.loop import train
from trainstack.runtime.preflight import preflight
from trainstack.runtime.progress import ProgressDisplay
from trainstack.storage import (
    Location,
    StorePath,
    credential_env,
    is_store_uri,
    with_env_credentials,
)
from trainstack.strategies import WorkerContext
from trainstack.telemetry import RunTelemetry
from trainstack.tracking import Tracker, start_tracking


class RunFailedError(RuntimeError):
    """The worker group failed for good (after any allowed restarts)."""


def connect(address: str | None, *, log_to_driver: bool = True) -> bool:
    """Connect to Ray as `ray_target` says; return True when this call started an
    embedded local instance."""
    target = ray_target(address)
    if target == "cluster":
        ray.init(address=address or os.environ["RAY_ADDRESS"], log_to_driver=log_to_driver)
    elif target == "local":
        # "local": a new instance even when a `ray start` cluster runs on this machine.
        ray.init(address="local", log_to_driver=log_to_driver)
    return target == "local"


def dashboard_line() -> str:
    """Where to watch the run (call once connected): the Ray dashboard's address and,
    with token authentication on, how to get past its login."""
    from ray._private import worker
    from ray._private.authentication.authentication_utils import is_token_auth_enabled

    node = worker._global_node
    url = f"http://{node.webui_url}" if node is not None and node.webui_url else None
    line = f"Ray dashboard: {url}" if url else "Ray dashboard: not started by this Ray"
    if url and is_token_auth_enabled():
        line += " (it asks for the cluster's token: paste what `ray get-auth-token` prints)"
    return line


def ray_target(address: str | None) -> str | None:
    """What `connect(address)` will do: `local` (start an embedded instance on this
    machine), `cluster` (join `address`, else `$RAY_ADDRESS`), or None (Ray is already
    running in this process)."""
    if ray.is_initialized():
        return None
    return "cluster" if address or os.environ.get("RAY_ADDRESS") else "local"


class RayCheckpointStore:
    """Each rank hands its staged files to Ray Train, which merges them in storage."""

    def commit(self, staging: Path, *, name: str, metrics: dict[str, Any]) -> None:
        ray.train.report(
            metrics,
            checkpoint=ray.train.Checkpoint.from_directory(str(staging)),
            checkpoint_dir_name=name,
        )


class FailureWatch(ray.train.UserCallback):
    """Runs in the Train controller: tells the driver when it saw workers fail."""

    def __init__(self, events: Queue) -> None:
        self.events = events

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
        rank, error = next(iter(sorted(worker_exceptions.items())))
        last_line = _last_line(error)
        with contextlib.suppress(Exception):
            self.events.put_nowait(
                {"event": "failure", "rank": rank, "error": last_line[:300], "time": time.time()}
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


def on_this_node() -> NodeAffinitySchedulingStrategy:
    """Placement beside the driver, for the run's small actors (the event queue): they
    live and die with the driver, never with a worker node that is lost."""
    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)


def worker_env(cfg: JobConfig) -> dict[str, str]:
    """Environment the workers need that a `ray start` cluster would not give them."""
    env: dict[str, str] = {}
    user_paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if user_paths:  # where the user's model and loss code lives (model.target, task.loss)
        env["PYTHONPATH"] = os.pathsep.join(str(Path(p).resolve()) for p in user_paths)
    if cfg.strategy.kind == "zero":  # DeepSpeed's JIT-built ops (cpu_adam): build once, reuse
        cache = os.environ.get("TORCH_EXTENSIONS_DIR") or ".cache/torch_extensions"
        env["TORCH_EXTENSIONS_DIR"] = str(Path(cache).resolve())
    if is_store_uri(cfg.checkpoint.storage_path):
        # Object-store credentials travel in the workers' runtime env (never in the spec,
        # which every checkpoint copies): each worker builds its own pyarrow filesystem
        # from `checkpoint.storage_options`, and pyarrow reads these from its environment.
        env.update(credential_env())
    return env


def _quiet_report_logs() -> None:
    """Ray Train logs every report() at INFO, metrics and all, under loggers named by
    file path (outside `ray.train`'s level setting); rank 0's progress says it better."""
    from ray.train.v2._internal.execution import context

    logging.getLogger(context.__file__).setLevel(logging.WARNING)


def _train_worker(loop_config: dict[str, Any]) -> None:
    """Body of each Ray Train worker actor."""
    _quiet_report_logs()
    cfg = config_from_dict(loop_config["spec"])
    context = ray.train.get_context()
    ctx = WorkerContext(
        rank=context.get_world_rank(),
        world_size=context.get_world_size(),
        local_rank=context.get_local_rank(),
        device=ray.train.torch.get_device(),
    )
    events: Queue = loop_config["events"]

    def on_event(record: dict[str, Any]) -> None:
        with contextlib.suppress(Exception):  # progress is best-effort; training goes on
            events.put_nowait(record)

    resume_from = loop_config["resume_from"]
    train(
        cfg,
        ctx,
        run_dir=Path(loop_config["run_dir"]),
        store=RayCheckpointStore(),
        checkpoints=ckpt.location(loop_config["checkpoints"], cfg),  # its own store client
        resume_from=ckpt.location(resume_from, cfg) if resume_from else None,
        on_event=on_event,
    )


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
        if self.on_record is not None:
            self.on_record(record)
        event = record.get("event")
        if event is None:
            self.last_step = record["step"]
            self.tracker.log_metrics({**record, "restarts": self.restarts}, step=record["step"])
            if self.display is not None:
                self.display.update({**record, "restarts": self.restarts})
        elif event == "start":
            self.starts.append(record)
            self.last_step = record["resumed_from_step"]
            self._note_resize(record)
            if self.restarts and self.telemetry is not None:
                self.telemetry.record_restart("worker_group")
            if self.display is not None:
                if self.restarts:
                    self.display.note(
                        f"worker group restarted ({self.restarts}), resuming from step "
                        f"{record['resumed_from_step']}"
                    )
                elif record["resumed_from_step"]:
                    self.display.note(f"resuming from step {record['resumed_from_step']}")
                for note in record.get("notes", []):
                    self.display.note(note)
        elif event == "first_step":
            self.last_step = record["step"]
        elif event == "fault":
            self.faults.append({**record, "attempt": self.attempt})
        elif event == "failure":
            self.failures.append({**record, "attempt": self.attempt, "after_step": self.last_step})
            if self.display is not None:
                self.display.note(f"worker {record['rank']} failed: {record['error']}")
        elif event == "compression":  # adaptive compression changed its ratio
            self.tracker.log_metrics(
                {"compression_topk_ratio": record["ratio"]}, step=record["step"]
            )
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


def run_job(
    cfg: JobConfig,
    *,
    address: str | None = None,
    display: ProgressDisplay | None = None,
    resume_from: Location | None = None,
    on_record: Callable[[dict[str, Any]], None] | None = None,
    tracking_tags: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Train `cfg` on a Ray worker group; return the summary.

    `on_record` sees every log record and run event as the driver receives it;
    `tracking_tags` go on a new MLflow run (a sweep's trials name their parent run).

    Raises ConfigError before anything starts when pre-flight finds the job cannot run
    (runtime/preflight.py), the local Ray instance it would start could never hold it
    (runtime/capacity.py), or a `ps` job is given `resume_from`, CheckpointError when
    the checkpoints to resume from do not verify, hold another model or data, or are the
    run's own from another spec (`checkpoint.checked_start`), and RunFailedError when the
    worker group fails for good or finds no room within `scaling.start_timeout_s`.
    """
    wall_start = time.perf_counter()
    if resume_from is not None and cfg.strategy.kind == "ps":
        raise ConfigError(
            f"--resume-from {resume_from}: strategy.kind=ps cannot start from a checkpoint "
            "(its shards start from the seed); drop --resume-from, or start from that "
            "checkpoint with strategy.kind ddp, zero or pipeline"
        )
    choice = None
    if cfg.strategy.kind == "auto":  # the plan's recommended layout, said and tracked
        cfg, choice = resolve_auto(cfg)
        if display is not None:
            display.note(choice)
        tracking_tags = {**(tracking_tags or {}), "trainstack.strategy_choice": choice}
    target = ray_target(address)
    if target == "local":  # the workers can only ever have this machine
        check_fits_this_machine(cfg)
        check_layout_fits(cfg)
    report = preflight(cfg)
    cfg = report.cfg
    run_dir = ckpt.run_dir_for(cfg)  # local: tracking record, fault markers, telemetry
    checkpoints = ckpt.checkpoints_for(cfg)  # run_dir, or the run's folder in an object store
    start = ckpt.checked_start(
        cfg,
        resume_from=resume_from,
        shapes=report.shapes,
        data_fingerprint=report.data_fingerprint,
    )
    if start is not None and start.step >= cfg.train.steps:
        summary = dict(start.manifest["metrics"])
        summary.update(
            already_complete=True, run_dir=str(checkpoints), final_checkpoint=str(start.path)
        )
        return summary

    started_local = connect(address)
    if display is not None:
        display.note(dashboard_line())
    waiting = cluster_wait_note(cfg, ray.available_resources()) if target == "cluster" else None
    if waiting is not None and display is not None:
        display.note(waiting)
    # data.kind: ray: the driver builds the datasets Ray Train splits among the workers
    datasets = ray_datasets(cfg) if cfg.data.kind == "ray" else None
    tracker = start_tracking(cfg, run_dir=run_dir, tags=tracking_tags)
    if cfg.strategy.kind == "ps":
        return _run_parameter_server(
            cfg, tracker=tracker, display=display, on_record=on_record, started_local=started_local
        )
    follower = RunFollower(
        display=display,
        tracker=tracker,
        on_record=on_record,
        telemetry=RunTelemetry.for_driver(cfg, run_dir=run_dir),
    )
    events = Queue(
        actor_options={
            "name": f"trainstack-events-{cfg.name}-{uuid.uuid4().hex[:6]}",
            "num_cpus": 0,
            "scheduling_strategy": on_this_node(),
        }
    )
    s = cfg.scaling
    resources: dict[str, float] = {"CPU": s.cpus_per_worker, **s.resources_per_worker}
    if s.use_gpu:
        resources["GPU"] = 1
    # Elastic: Ray Train starts with as many as fit (at least min) and resizes the group.
    workers = (s.min_workers, s.num_workers) if s.elastic else s.num_workers
    trainer = TorchTrainer(
        train_loop_per_worker=_train_worker,
        datasets=datasets,
        dataset_config=ray_ingest_config() if datasets else None,
        train_loop_config={
            "spec": config_to_dict(cfg),
            "events": events,
            "run_dir": str(run_dir),
            "checkpoints": str(checkpoints),
            "resume_from": str(resume_from) if resume_from else None,
        },
        scaling_config=ray.train.ScalingConfig(  # type: ignore[call-arg]  # V2's, typed as AIR's
            num_workers=workers,  # type: ignore[arg-type]
            use_gpu=s.use_gpu,
            resources_per_worker=resources,
            elastic_resize_monitor_interval_s=s.resize_check_s,
        ),
        run_config=ray.train.RunConfig(
            name=cfg.name,
            **_ray_storage(cfg, checkpoints),
            failure_config=_failure_config(cfg),
            callbacks=[FailureWatch(events), StartAttemptWatch(events)],  # type: ignore[list-item]
            logging_config=ray.train.LoggingConfig(log_level="WARNING"),  # type: ignore[call-arg]
            worker_runtime_env={"env_vars": worker_env(cfg)},
        ),
    )
    outcome: dict[str, Any] = {}

    def fit() -> None:
        try:
            with worker_group_start_timeout(attempt_timeout_s(cfg)):
                outcome["result"] = trainer.fit()
        except Exception as err:  # surfaced on the driver's thread below
            outcome["error"] = err

    fitting = threading.Thread(target=fit, name="trainstack-fit", daemon=True)
    fitting.start()
    try:
        while fitting.is_alive():
            _drain(events, follower, timeout=0.5)
        _drain(events, follower, timeout=0)
    finally:
        if display is not None:
            display.close()
        ray.kill(events.actor)  # type: ignore[arg-type]
        if started_local:
            ray.shutdown()

    error = outcome.get("error") or outcome["result"].error
    if error is not None:
        tracker.finish({"failures": len(follower.failures)}, failed=True)
        if is_start_timeout(error):
            raise RunFailedError(start_timeout_message(cfg))
        raise RunFailedError(_failure_summary(follower, error))
    result = outcome["result"]
    summary = dict(result.metrics or {})
    summary.update(
        wall_s=time.perf_counter() - wall_start,
        run_dir=str(checkpoints),
        final_checkpoint=str(checkpoints / Path(result.checkpoint.path).name)
        if result.checkpoint
        else None,
        restarts=follower.restarts,
        recovery=follower.recovery(),
        resizes=follower.resizes,
        mlflow_run_id=tracker.run_id,
        tracking_error=tracker.error,
        strategy_choice=choice,
    )
    tracker.finish(summary, failed=False)
    return summary


def _ray_storage(cfg: JobConfig, checkpoints: Location) -> dict[str, Any]:
    """Where Ray Train keeps the run (`storage_path/name`): the local folder, or the object
    store's filesystem and the path in it (`bucket/prefix`).

    Ray Train's controller writes its own state there from a process that has its
    raylet's environment, not the driver's (on a `ray start` cluster, no credentials):
    the filesystem handed to it carries the driver's AWS keys, which pickling keeps."""
    if isinstance(checkpoints, StorePath):
        fs = with_env_credentials(checkpoints, cfg.checkpoint.storage_options)
        return {"storage_path": checkpoints.parent.path, "storage_filesystem": fs}
    return {"storage_path": str(checkpoints.parent)}


def _failure_config(cfg: JobConfig) -> ray.train.FailureConfig:
    """Worker-group restarts per `failure.max_failures`, and as many start attempts that
    fail or find no room within `scaling.start_timeout_s` (0: start attempts wait
    forever). A group restarted just after a node is lost can land on that node before
    Ray has seen it die and fail to start: that costs one attempt, not the run."""
    attempts = cfg.failure.max_failures if attempt_timeout_s(cfg) else -1
    return ray.train.FailureConfig(  # type: ignore[call-arg]  # Train V2's, typed as AIR's
        max_failures=cfg.failure.max_failures, controller_failure_limit=attempts
    )


def _run_parameter_server(
    cfg: JobConfig,
    *,
    tracker: Tracker,
    display: ProgressDisplay | None,
    on_record: Callable[[dict[str, Any]], None] | None,
    started_local: bool,
) -> dict[str, Any]:
    """A `ps` job: plain Ray actors instead of a Train worker group (trainstack.ps)."""
    from trainstack.ps.driver import WorkerFailedError, run_parameter_server

    def on_progress(record: dict[str, Any]) -> None:
        tracker.log_metrics(record, step=record["step"])
        if on_record is not None:
            on_record(record)

    try:
        summary = run_parameter_server(cfg, display=display, on_progress=on_progress)
    except WorkerFailedError as err:
        tracker.finish({}, failed=True)
        raise RunFailedError(str(err)) from err
    finally:
        if display is not None:
            display.close()
        if started_local:
            ray.shutdown()
    summary.update(mlflow_run_id=tracker.run_id, tracking_error=tracker.error)
    tracker.finish(summary, failed=False)
    return summary


def _failure_summary(follower: RunFollower, error: BaseException) -> str:
    failures = follower.failures
    steps = ", ".join(str(f["after_step"]) for f in failures) or "?"
    last = failures[-1]["error"] if failures else str(error).strip().splitlines()[-1]
    controller = getattr(error, "controller_failure", None)
    if controller is not None:  # the controller gave up (out of start attempts): say why
        last = _last_line(controller)
    return (
        f"training failed after {len(failures)} worker failure(s) "
        f"(last steps known finished before each: {steps}); last error: {last}"
    )


def _last_line(error: BaseException) -> str:
    """The last line of `error`'s message (Ray's errors end with what went wrong), or its
    type's name when it has none."""
    return (str(error).strip().splitlines() or [type(error).__name__])[-1]


def _drain(queue: Queue, follower: RunFollower, *, timeout: float) -> None:
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
