"""MLflow tracking for a job: one run per job, driven by the driver process.

The driver lives across worker-group restarts, so a restarted group keeps logging
into the same run, and workers on remote nodes never need the tracking store. The
run id is kept in `<run_dir>/tracking.json`; a resumed job (same name and storage)
finds it there and continues that run instead of starting a second one.

A tracking outage never kills training: every MLflow call goes through one guard
that records the first error, prints one warning line and turns the tracker into a
no-op for the rest of the job.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import yaml

import trainstack
from trainstack.config import JobConfig, config_to_dict
from trainstack.files import write_text_atomically

RECORD_FILE = "tracking.json"
MAX_PARAM_CHARS = 6000
"""MLflow rejects param values longer than this."""
PARAMS_PER_BATCH = 100
"""MLflow's limit on params in one `log_batch` call."""
HTTP_BOUNDS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
"""Defaults (7 retries, 120 s) would hang a job for minutes on an unreachable server."""

_T = TypeVar("_T")


class Tracker(Protocol):
    run_id: str | None
    """The MLflow run id; None for no tracking (or when the run could not be started)."""
    error: str | None
    """First tracking error, one line; None while healthy."""

    def log_metrics(self, metrics: Mapping[str, Any], *, step: int) -> None: ...

    def finish(self, summary: Mapping[str, Any], *, failed: bool) -> None: ...


@dataclass(kw_only=True)
class NullTracker:
    """`tracking.backend: none`: logs nothing."""

    run_id: str | None = None
    error: str | None = None

    def log_metrics(self, metrics: Mapping[str, Any], *, step: int) -> None:
        pass

    def finish(self, summary: Mapping[str, Any], *, failed: bool) -> None:
        pass


@dataclass(kw_only=True)
class TrackingRecord:
    """What `<run_dir>/tracking.json` holds: enough to find the job's run again."""

    tracking_uri: str
    experiment_id: str
    run_id: str


def start_tracking(
    cfg: JobConfig, *, run_dir: Path, tags: Mapping[str, str] | None = None
) -> Tracker:
    """`tracking.backend: none` -> a no-op tracker (mlflow is NOT imported); else an MLflow run.

    `tags` are added to a new run (a sweep nests its trials with `mlflow.parentRunId`).
    Never raises for a tracking failure: the returned tracker has `error` set instead.
    """
    if cfg.tracking.backend == "none":
        return NullTracker()
    tracker = mlflow_tracker(cfg.tracking.uri)
    tracker.guarded("start", lambda: tracker.start(cfg, run_dir=run_dir, tags=tags))
    return tracker


def mlflow_tracker(uri: str) -> MlflowTracker:
    """An MlflowTracker for `uri` (resolved by `resolve_tracking_uri`); its run is opened
    by `start` or `open`.

    Sets (only if unset) MLFLOW_HTTP_REQUEST_MAX_RETRIES=2 and MLFLOW_HTTP_REQUEST_TIMEOUT=10
    in this process, so an unreachable tracking server fails in seconds, not minutes.
    """
    for name, value in HTTP_BOUNDS.items():
        os.environ.setdefault(name, value)
    return MlflowTracker(tracking_uri=resolve_tracking_uri(uri))


def resolve_tracking_uri(uri: str) -> str:
    """The configured URI, else $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db; a relative
    sqlite path is made absolute against the working directory."""
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI", "") or "sqlite:///mlflow.db"
    prefix = "sqlite:///"
    path = uri.removeprefix(prefix)
    if uri.startswith(prefix) and path and path != ":memory:" and not os.path.isabs(path):
        return prefix + str(Path.cwd() / path)
    return uri


@dataclass(kw_only=True)
class MlflowTracker:
    tracking_uri: str
    run_id: str | None = None
    error: str | None = None
    client: Any = None
    """An `mlflow.MlflowClient` bound to `tracking_uri` (no global fluent-API state)."""
    last_step: int = 0

    def guarded(self, what: str, call: Callable[[], _T]) -> _T | None:
        """Run one MLflow call; the first failure disables tracking for good."""
        if self.error is not None:
            return None
        try:
            return call()
        except Exception as e:
            first_line = (str(e).strip().splitlines() or [""])[0][:300]
            message = f": {first_line}" if first_line else ""
            self.error = f"mlflow tracking failed at {what}: {type(e).__name__}{message}"
            warning = f"trainstack: warning: {self.error}; training continues without tracking"
            print(warning, file=sys.stderr, flush=True)
            return None

    def start(
        self, cfg: JobConfig, *, run_dir: Path, tags: Mapping[str, str] | None = None
    ) -> None:
        """Open the job's run (see `open`) and log its spec."""
        spec = config_to_dict(cfg)
        self.open(
            run_dir=run_dir,
            experiment=cfg.tracking.experiment,
            run_name=cfg.name,
            tags={
                "trainstack.strategy": cfg.strategy.kind,
                "trainstack.world_size": str(cfg.scaling.num_workers),
                **(tags or {}),
            },
            params=_flatten(spec),
        )
        self.client.log_text(self.run_id, yaml.safe_dump(spec, sort_keys=False), "spec.yaml")

    def open(
        self,
        *,
        run_dir: Path,
        experiment: str,
        run_name: str,
        tags: Mapping[str, str],
        params: Mapping[str, str],
    ) -> None:
        """Continue the run named in `<run_dir>/tracking.json` when it is still in this
        store, else create one with `tags` and `params` and record it there."""
        import mlflow

        self.client = mlflow.MlflowClient(tracking_uri=self.tracking_uri)
        experiment_id = self._experiment_id(experiment)
        record_path = run_dir / RECORD_FILE
        run = self._continuable_run(_read_record(record_path), experiment_id)
        if run is not None:
            self.run_id = run.info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
            resumed = int(run.data.tags.get("trainstack.resumed_count", "0")) + 1
            self.client.set_tag(self.run_id, "trainstack.resumed_count", str(resumed))
            return
        self.run_id = self._new_run(experiment_id, run_name=run_name, tags=tags, params=params)
        record = TrackingRecord(
            tracking_uri=self.tracking_uri, experiment_id=experiment_id, run_id=self.run_id
        )
        _write_record(record_path, record)

    def log_file(self, path: Path) -> None:
        """Attach a file to the run as an artifact (at the artifact root)."""
        if self.run_id is not None:
            run_id = self.run_id
            self.guarded("log_file", lambda: self.client.log_artifact(run_id, str(path)))

    def log_metrics(self, metrics: Mapping[str, Any], *, step: int) -> None:
        values = {k: v for k, v in metrics.items() if k not in ("step", "steps")}
        self.last_step = step
        self.guarded("log_metrics", lambda: self._log_batch(values, step=step))

    def finish(self, summary: Mapping[str, Any], *, failed: bool) -> None:
        def close(run_id: str) -> None:
            text = json.dumps(dict(summary), indent=2, default=str)
            self.client.log_text(run_id, text, "summary.json")
            final = {f"final/{k}": v for k, v in summary.items()}
            self._log_batch(final, step=self.last_step)
            self.client.set_terminated(run_id, status="FAILED" if failed else "FINISHED")

        if self.run_id is not None:
            run_id = self.run_id
            self.guarded("finish", lambda: close(run_id))

    def _log_batch(self, values: Mapping[str, Any], *, step: int) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        batch = [
            Metric(key=key, value=value, timestamp=now_ms, step=step)
            for key, value in _finite_numbers(values).items()
        ]
        if batch and self.run_id is not None:
            self.client.log_batch(self.run_id, metrics=batch)

    def _experiment_id(self, name: str) -> str:
        experiment = self.client.get_experiment_by_name(name)
        if experiment is not None:
            return str(experiment.experiment_id)
        location = _artifact_location(self.tracking_uri)
        return str(self.client.create_experiment(name, artifact_location=location))

    def _continuable_run(self, record: TrackingRecord | None, experiment_id: str) -> Any:
        """The run named by `record` if it is in this store and experiment and not deleted."""
        from mlflow.exceptions import MlflowException

        same_store = (self.tracking_uri, experiment_id)
        if record is None or (record.tracking_uri, record.experiment_id) != same_store:
            return None
        try:
            run = self.client.get_run(record.run_id)
        except MlflowException as e:
            if e.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            return None
        return run if run.info.lifecycle_stage == "active" else None

    def _new_run(
        self,
        experiment_id: str,
        *,
        run_name: str,
        tags: Mapping[str, str],
        params: Mapping[str, str],
    ) -> str:
        from mlflow.entities import Param

        all_tags = {"trainstack.version": trainstack.__version__, **tags}
        commit = _git_commit()
        if commit:
            all_tags["trainstack.git_commit"] = commit
        run = self.client.create_run(experiment_id, run_name=run_name, tags=all_tags)
        batch = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(batch), PARAMS_PER_BATCH):
            self.client.log_batch(run.info.run_id, params=batch[i : i + PARAMS_PER_BATCH])
        return str(run.info.run_id)


def _artifact_location(tracking_uri: str) -> str | None:
    """Artifacts of a SQLite store live next to its database file (not in ./mlruns)."""
    path = tracking_uri.removeprefix("sqlite:///").split("?")[0]
    if not tracking_uri.startswith("sqlite:///") or not os.path.isabs(path):
        return None
    return str(Path(path).parent / "mlartifacts")


def _flatten(spec: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """`{"model": {"n_layer": 2}}` -> `{"model.n_layer": "2"}` (lists as their str)."""
    flat: dict[str, str] = {}
    for key, value in spec.items():
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = str(value)[:MAX_PARAM_CHARS]
    return flat


def _finite_numbers(values: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Finite numbers of `values`; nested mappings become `outer.inner` keys."""
    out: dict[str, float] = {}
    for key, value in values.items():
        if isinstance(value, Mapping):
            out.update(_finite_numbers(value, prefix=f"{prefix}{key}."))
        elif (
            isinstance(value, numbers.Real)
            and not isinstance(value, bool)
            and math.isfinite(float(value))
        ):
            out[prefix + key] = float(value)
    return out


def _git_commit() -> str | None:
    try:
        done = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=2, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _read_record(path: Path) -> TrackingRecord | None:
    try:
        return TrackingRecord(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):  # absent or unreadable: start a new run
        return None


def _write_record(path: Path, record: TrackingRecord) -> None:
    write_text_atomically(path, json.dumps(asdict(record), indent=2) + "\n")
