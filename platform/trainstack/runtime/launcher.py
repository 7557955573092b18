"""Runs a job on Ray: a synchronous strategy on a Ray Train V2 worker group, and a
`strategy.kind: ps` job on plain Ray actors (handed to `trainstack.runtime.ps_job`).

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
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard

import ray
import ray.train
import ray.train.torch
from ray.util.queue import Queue

if TYPE_CHECKING:
    import torch.distributed as dist

from trainstack import checkpoint as ckpt
from trainstack.compat.ray import (
    quiet_train_report_logs,
    torch_trainer,
    train_logging_config,
)
from trainstack.config import ConfigError, JobConfig, config_from_dict, config_to_dict
from trainstack.data.ray_source import ray_datasets, ray_ingest_config
from trainstack.kinds import data_kind_of, kind_of
from trainstack.observe.prometheus import RunTelemetry
from trainstack.observe.tracking import Tracker, start_tracking
from trainstack.planner.choose import check_layout_fits, resolve_auto
from trainstack.runtime.capacity import (
    attempt_timeout_s,
    check_fits_this_machine,
    cluster_wait_note,
    controller_settings,
    is_start_timeout,
    start_timeout_message,
)
from trainstack.runtime.cluster import connect, dashboard_line, on_this_node, ray_target, worker_env
from trainstack.runtime.events import RunFollower, controller_watches, drain, last_line
from trainstack.runtime.loop import train
from trainstack.runtime.preflight import preflight
from trainstack.runtime.progress import ProgressDisplay
from trainstack.runtime.stack_check import check_cluster_versions, check_versions_here
from trainstack.storage import (
    Location,
    StorePath,
    with_env_credentials,
)
from trainstack.strategies import WorkerContext


class RunFailedError(RuntimeError):
    """The worker group failed for good (after any allowed restarts)."""


class RayCheckpointStore:
    """Each rank hands its staged files to Ray Train, which merges them in storage."""

    def commit(
        self,
        staging: Path,
        *,
        name: str,
        metrics: dict[str, Any],
        group: dist.ProcessGroup | None = None,
    ) -> None:
        """Ray Train's report (its own synchronisation across ranks; `group` unused). Only
        checkpoints are reported, so a background save's thread is the only caller."""
        ray.train.report(
            metrics,
            checkpoint=ray.train.Checkpoint.from_directory(str(staging)),
            checkpoint_dir_name=name,
        )


def _train_worker(loop_config: dict[str, Any]) -> None:
    """Body of each Ray Train worker actor."""
    quiet_train_report_logs()  # rank 0's progress says what Ray Train's report lines would
    cfg = config_from_dict(loop_config["spec"])
    context = ray.train.get_context()
    ctx = WorkerContext(
        rank=context.get_world_rank(),
        world_size=context.get_world_size(),
        local_rank=context.get_local_rank(),
        device=ray.train.torch.get_device(),
        node=ray.get_runtime_context().get_node_id(),
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
    wall_start, began = time.perf_counter(), time.time()
    _note(display, check_versions_here(cfg))  # raises for a library too old or missing
    if resume_from is not None and not kind_of(cfg).resumes_other_runs:
        raise ConfigError(
            f"--resume-from {resume_from}: strategy.kind=ps cannot start from a checkpoint "
            "(its shards start from the seed); drop --resume-from, or start from that "
            "checkpoint with strategy.kind ddp, zero or pipeline"
        )
    choice = None
    if kind_of(cfg).runs_on == "plan":  # the plan's recommended layout, said and tracked
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

    checked = time.time()
    started_local = connect(address)
    if target == "cluster":  # every node, as the job's processes there will see it
        _note(display, check_cluster_versions(cfg))
    connected = time.time()
    if display is not None:
        display.note(dashboard_line())
    waiting = cluster_wait_note(cfg, ray.available_resources()) if target == "cluster" else None
    if waiting is not None and display is not None:
        display.note(waiting)
    # Ray Data: the driver builds the datasets Ray Train splits among the workers
    datasets = ray_datasets(cfg) if data_kind_of(cfg).streams else None
    tracker = start_tracking(cfg, run_dir=run_dir, tags=tracking_tags)
    if kind_of(cfg).runs_on == "actors":
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
    trainer = torch_trainer(  # less the helper actors the run has no use for
        embedded=started_local,
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
        scaling_config=_scaling_config(cfg),
        run_config=ray.train.RunConfig(  # type: ignore[call-arg]  # Train V2's, typed as AIR's
            name=cfg.name,
            **_ray_storage(cfg, checkpoints),
            failure_config=_failure_config(cfg),
            callbacks=controller_watches(events),
            worker_runtime_env={"env_vars": worker_env(cfg)},
            **_quiet_driver_logs(),
        ),
    )
    outcome: dict[str, Any] = {}

    def fit() -> None:
        try:
            with controller_settings(cfg):
                outcome["result"] = trainer.fit()
        except Exception as err:  # surfaced on the driver's thread below
            outcome["error"] = err

    fitting = threading.Thread(target=fit, name="trainstack-fit", daemon=True)
    fitting.start()
    try:
        while fitting.is_alive():
            drain(events, follower, timeout=0.5)
        drain(events, follower, timeout=0)
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
        raise RunFailedError(_failure_summary(follower, error, checkpoints))
    result = outcome["result"]
    startup = follower.startup(began=began, checked=checked, connected=connected)
    summary = dict(result.metrics or {})
    summary.update(
        wall_s=time.perf_counter() - wall_start,
        run_dir=str(checkpoints),
        final_checkpoint=str(checkpoints / Path(result.checkpoint.path).name)
        if result.checkpoint
        else None,
        startup=startup,
        time_to_first_step_s=startup["to_first_step_s"] if startup else None,
        restarts=follower.restarts,
        recovery=follower.recovery(),
        resizes=follower.resizes,
        mlflow_run_id=tracker.run_id,
        tracking_error=tracker.error,
        strategy_choice=choice,
    )
    split = follower.goodput(began=began, ended=time.time(), final=summary)
    summary.update({"goodput": split.pop("goodput"), "goodput_wall_s": split.pop("wall_s")})
    summary.update({f"goodput_{part}": seconds for part, seconds in split.items()})
    tracker.finish(summary, failed=False)
    return summary


def _scaling_config(cfg: JobConfig) -> ray.train.ScalingConfig:
    """One worker actor per rank with its CPUs, GPU and custom resources. Elastic: Ray
    Train starts with as many as fit (at least `min_workers`) and resizes the group,
    looking for room every `scaling.resize_check_s` (Ray 2.55 on: pre-flight refuses it
    before)."""
    s = cfg.scaling
    resources: dict[str, float] = {"CPU": s.cpus_per_worker, **s.resources_per_worker}
    if s.use_gpu:
        resources["GPU"] = 1
    workers: dict[str, Any] = {"num_workers": s.num_workers}
    if s.elastic:
        workers = {
            "num_workers": (s.min_workers, s.num_workers),
            "elastic_resize_monitor_interval_s": s.resize_check_s,
        }
    return ray.train.ScalingConfig(use_gpu=s.use_gpu, resources_per_worker=resources, **workers)


def _quiet_driver_logs() -> dict[str, Any]:
    """Ray Train's own log level WARNING, where this Ray has `ray.train.LoggingConfig`
    (2.56 on; before, its default)."""
    logging_config = train_logging_config()
    return {} if logging_config is None else {"logging_config": logging_config(log_level="WARNING")}


def _note(display: ProgressDisplay | None, note: str | None) -> None:
    if note is not None and display is not None:
        display.note(note)


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
    from trainstack.runtime.ps_job import WorkerFailedError, run_parameter_server

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


def _failure_summary(follower: RunFollower, error: BaseException, checkpoints: Location) -> str:
    failures = follower.failures
    steps = ", ".join(str(after_step) for _, after_step, _ in failures) or "?"
    last = failures[-1][2].error if failures else str(error).strip().splitlines()[-1]
    controller = getattr(error, "controller_failure", None)
    if controller is not None:  # the controller gave up (out of start attempts): say why
        last = last_line(controller)
    if isinstance(checkpoints, StorePath) and _is_store_error(controller):
        # Ray Train's controller writes its run state beside the checkpoints, so an
        # object store's outage can end the run there before any rank's save meets it
        last = str(ckpt.unreachable_store(checkpoints, controller))
    return (
        f"training failed after {len(failures)} worker failure(s) "
        f"(last steps known finished before each: {steps}); last error: {last}"
    )


def _is_store_error(error: object) -> TypeGuard[OSError]:
    """An I/O error that is not a missing file (which says the store answered)."""
    return isinstance(error, OSError) and not isinstance(error, FileNotFoundError)
