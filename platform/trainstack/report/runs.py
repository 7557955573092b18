"""A tracked run as `trainstack report` reads it: everything comes from the run's MLflow
record as `trainstack.observe.tracking` writes it (the per-step metric histories, the
`summary.json` and `spec.yaml` artifacts and the run's tags)."""

from __future__ import annotations

import json
import math
import numbers
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainstack.config import ConfigError
from trainstack.observe.tracking import (
    HTTP_BOUNDS,
    RECORD_FILE,
    TrackingRecord,
    resolve_tracking_uri,
)

MIB = 2**20


@dataclass(frozen=True, kw_only=True)
class Series:
    """One metric's history in logging order; a replayed or resumed step appears again."""

    steps: list[int]
    values: list[float]
    times_s: list[float]
    """When each value was logged, in seconds since the run started (monotonic across
    restarts, unlike the workers' `elapsed_s`)."""

    def pieces(self) -> list[range]:
        """Index ranges of the stretches whose steps only go forward (one per attempt)."""
        starts = [0] + [i for i in range(1, len(self.steps)) if self.steps[i] <= self.steps[i - 1]]
        ends = [*starts[1:], len(self.steps)]
        return [range(a, b) for a, b in zip(starts, ends, strict=True) if b > a]


@dataclass(frozen=True, kw_only=True)
class Restart:
    count: int
    """The `restarts` metric after it (1 for the first restart)."""
    step: int
    """The first step logged after the restart."""
    time_s: float
    """When that step was logged, seconds since the run started."""
    before_s: float
    """When the last step before the restart was logged."""


@dataclass(frozen=True, kw_only=True)
class TrackedRun:
    """What MLflow holds about one trainstack run."""

    run_id: str
    name: str
    status: str
    tracking_uri: str
    tags: dict[str, str]
    start_ms: int
    end_ms: int | None
    summary: dict[str, Any]
    """`summary.json`; empty when the run never finished (killed driver)."""
    spec_text: str | None
    """`spec.yaml` as logged; None for runs not started by `trainstack run`."""
    series: dict[str, Series]

    def number(self, key: str, *, within: str | None = None) -> float | None:
        """A finite number from the summary (or its `within` dict), else None."""
        source = self.summary.get(within, {}) if within else self.summary
        value = source.get(key) if isinstance(source, dict) else None
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            return float(value) if math.isfinite(float(value)) else None
        return None

    def restarts(self) -> list[Restart]:
        """Where the driver's `restarts` count goes up (none without that metric)."""
        found = self.series.get("restarts")
        steps, values, times = (found.steps, found.values, found.times_s) if found else ([], [], [])
        rises = [i for i in range(1, len(values)) if values[i] > values[i - 1]]
        return [
            Restart(count=int(values[i]), step=steps[i], time_s=times[i], before_s=times[i - 1])
            for i in rises
        ]


def load_run(run: str, *, tracking_uri: str | None) -> TrackedRun:
    """Read everything the report needs from MLflow. `tracking_uri` None: the run
    directory's recorded store, else $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db."""
    import mlflow

    for name, value in HTTP_BOUNDS.items():
        os.environ.setdefault(name, value)
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    run_id, uri = _locate(run, tracking_uri)
    _check_store_exists(uri)
    try:
        client = mlflow.MlflowClient(tracking_uri=uri)
        found = client.get_run(run_id)
    except Exception as e:  # MlflowException; a bad URI, a server that does not answer
        if getattr(e, "error_code", None) == "RESOURCE_DOES_NOT_EXIST":
            raise ConfigError(
                f"no MLflow run {run_id!r} in {uri}: RUN must be a run id in that store "
                "(the 'mlflow run' line of `trainstack run`) or a run directory with "
                "tracking.json; pass --tracking-uri for another store"
            ) from None
        raise ConfigError(f"cannot read tracking store {uri}: {_first_line(e)}") from None
    summary_text = _artifact_text(client, run_id, "summary.json")
    keys = sorted(k for k in found.data.metrics if not k.startswith("final/"))
    start_ms = int(found.info.start_time)
    return TrackedRun(
        run_id=run_id,
        name=found.info.run_name or run_id,
        status=found.info.status,
        tracking_uri=uri,
        tags=dict(found.data.tags),
        start_ms=start_ms,
        end_ms=found.info.end_time,
        summary=json.loads(summary_text) if summary_text else {},
        spec_text=_artifact_text(client, run_id, "spec.yaml"),
        series={k: _series(client.get_metric_history(run_id, k), start_ms) for k in keys},
    )


def _locate(run: str, tracking_uri: str | None) -> tuple[str, str]:
    """(run id, resolved tracking URI) for a run id or a run directory."""

    path = Path(run).expanduser()
    if path.is_dir():
        record_path = path / RECORD_FILE
        if not record_path.is_file():
            raise ConfigError(
                f"run directory {str(path)!r} has no {RECORD_FILE}: RUN must be an MLflow run "
                "id or the directory of a run trained with tracking.backend: mlflow"
            )
        try:
            record = TrackingRecord(**json.loads(record_path.read_text()))
        except (OSError, ValueError, TypeError):
            raise ConfigError(
                f"{str(record_path)!r} is not a tracking record: expected JSON with "
                "tracking_uri, experiment_id and run_id"
            ) from None
        return record.run_id, resolve_tracking_uri(tracking_uri or record.tracking_uri)
    if os.sep in run or run.startswith("."):
        raise ConfigError(
            f"run directory {run!r} does not exist: RUN must be an MLflow run id or a run "
            "directory with tracking.json"
        )
    return run, resolve_tracking_uri(tracking_uri or "")


def _check_store_exists(uri: str) -> None:
    """A missing SQLite file is an error here: MLflow would create an empty store."""
    path = uri.removeprefix("sqlite:///").split("?")[0]
    if uri.startswith("sqlite:///") and path != ":memory:" and not Path(path).is_file():
        raise ConfigError(
            f"tracking store {uri} does not exist: pass --tracking-uri, set "
            "$MLFLOW_TRACKING_URI, or run where the job's mlflow.db is"
        )


def _artifact_text(client: Any, run_id: str, name: str) -> str | None:
    if name not in {a.path for a in client.list_artifacts(run_id)}:
        return None
    with tempfile.TemporaryDirectory(prefix="trainstack-report-") as tmp:
        return Path(client.download_artifacts(run_id, name, tmp)).read_text()


def _series(history: list[Any], start_ms: int) -> Series:
    ordered = sorted(history, key=lambda m: m.timestamp)  # stable: the store's order on ties
    return Series(
        steps=[int(m.step) for m in ordered],
        values=[float(m.value) for m in ordered],
        times_s=[(m.timestamp - start_ms) / 1000 for m in ordered],
    )


def _first_line(error: BaseException) -> str:
    text = (str(error).strip().splitlines() or [""])[0][:200]
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def mfu_missing(run: TrackedRun) -> str:
    device = str(run.summary.get("device", "")).upper()
    return f"n/a (no peak FLOPs known for {device})" if device else "n/a (not logged)"
