"""MLflow tracking against a real SQLite store: runs, continuity, and outages that never
kill training. One store is shared by the module (MLflow's import and the store's
migrations take seconds); each test uses its own experiment."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

import trainstack
from trainstack.config import JobConfig, TrackingConfig, config_to_dict
from trainstack.observe.tracking import HTTP_BOUNDS, resolve_tracking_uri, start_tracking

RECORDS: list[dict[str, Any]] = [
    {"step": 10, "steps": 30, "loss": 4.0, "lr": 0.003, "mfu": None, "grad_norm": float("nan")},
    {"step": 20, "steps": 30, "loss": 3.0, "lr": 0.002, "mfu": None, "grad_norm": 0.5},
]
SUMMARY = {"final_loss": 2.5, "tokens_per_s": 1e5, "strategy": "ddp", "world_size": 2}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    return f"sqlite:///{tmp_path_factory.mktemp('store') / 'mlflow.db'}"


@pytest.fixture(scope="module")
def client(store: str) -> Any:
    import mlflow

    return mlflow.MlflowClient(tracking_uri=store)


def job(uri: str, experiment: str, **kwargs: Any) -> JobConfig:
    tracking = TrackingConfig(backend="mlflow", uri=uri, experiment=experiment)
    return JobConfig(name=f"{experiment}-job", tracking=tracking, **kwargs)


def runs_in(client: Any, experiment: str) -> list[Any]:
    experiment_id = client.get_experiment_by_name(experiment).experiment_id
    return list(client.search_runs([experiment_id]))


def artifact_text(client: Any, run_id: str, name: str, tmp_path: Path) -> str:
    return Path(client.download_artifacts(run_id, name, str(tmp_path))).read_text()


def test_backend_none_is_a_no_op_that_never_imports_mlflow(tmp_path: Path) -> None:
    code = (
        "import sys; from pathlib import Path; from trainstack.config import JobConfig\n"
        "from trainstack.observe.tracking import start_tracking\n"
        f"t = start_tracking(JobConfig(), run_dir=Path({str(tmp_path)!r}))\n"
        "t.log_metrics({'loss': 1.0}, step=1); t.finish({'final_loss': 1.0}, failed=False)\n"
        "assert t.run_id is None and t.error is None\n"
        "assert 'mlflow' not in sys.modules, 'backend none imported mlflow'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert not list(tmp_path.iterdir())


def test_run_holds_params_tags_step_metrics_artifacts_and_ends_finished(
    store: str, client: Any, tmp_path: Path
) -> None:
    cfg = job(store, "full-run")
    tracker = start_tracking(cfg, run_dir=tmp_path / "run")
    for record in RECORDS:
        tracker.log_metrics(record, step=record["step"])
    tracker.finish(SUMMARY, failed=False)
    assert tracker.error is None and tracker.run_id is not None

    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == cfg.name
    params = run.data.params
    assert params["model.n_embd"] == str(cfg.model.n_embd)
    assert params["optim.betas"] == str(list(cfg.optim.betas))
    assert params["tracking.experiment"] == "full-run"
    tags = run.data.tags
    assert tags["trainstack.strategy"] == "ddp"
    assert tags["trainstack.world_size"] == str(cfg.scaling.num_workers)
    assert tags["trainstack.version"] == trainstack.__version__
    assert tags["mlflow.runName"] == cfg.name
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:
        assert tags["trainstack.git_commit"] == head.stdout.strip()

    loss = client.get_metric_history(tracker.run_id, "loss")
    assert [(m.step, m.value) for m in loss] == [(10, 4.0), (20, 3.0)]
    assert [m.step for m in client.get_metric_history(tracker.run_id, "grad_norm")] == [20]
    assert not {"step", "steps", "mfu"} & set(run.data.metrics)
    assert run.data.metrics["final/final_loss"] == 2.5
    assert run.data.metrics["final/world_size"] == 2
    assert "final/strategy" not in run.data.metrics

    spec = yaml.safe_load(artifact_text(client, tracker.run_id, "spec.yaml", tmp_path))
    assert spec == config_to_dict(cfg)
    summary = json.loads(artifact_text(client, tracker.run_id, "summary.json", tmp_path))
    assert summary == SUMMARY


def test_failed_job_ends_its_run_failed(store: str, client: Any, tmp_path: Path) -> None:
    tracker = start_tracking(job(store, "failed-run"), run_dir=tmp_path)
    tracker.finish({"final_loss": float("nan")}, failed=True)
    assert tracker.error is None and tracker.run_id is not None
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FAILED"
    assert "final/final_loss" not in run.data.metrics


def test_resumed_job_continues_its_run_without_a_duplicate(
    store: str, client: Any, tmp_path: Path
) -> None:
    cfg = job(store, "resumed-run")
    first = start_tracking(cfg, run_dir=tmp_path)
    first.log_metrics(RECORDS[0], step=10)
    first.finish(SUMMARY, failed=True)  # the job died; the user runs it again

    second = start_tracking(cfg, run_dir=tmp_path)
    assert second.run_id == first.run_id
    assert client.get_run(second.run_id).info.status == "RUNNING"
    second.log_metrics(RECORDS[1], step=20)
    second.finish(SUMMARY, failed=False)

    assert second.error is None
    [run] = runs_in(client, "resumed-run")
    assert run.info.run_id == first.run_id and run.info.status == "FINISHED"
    assert run.data.tags["trainstack.resumed_count"] == "1"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [10, 20]
    record = json.loads((tmp_path / "tracking.json").read_text())
    assert record["run_id"] == first.run_id and record["tracking_uri"] == store


@pytest.fixture
def http_bounds_unset(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Unset the HTTP bounds so start_tracking sets them; teardown restores the env."""
    for name in HTTP_BOUNDS:
        monkeypatch.setenv(name, "")  # records the original state for teardown
        monkeypatch.delenv(name)
    yield


def test_unreachable_server_disables_tracking_quickly_without_raising(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], http_bounds_unset: None
) -> None:
    """Quickly: MLflow's HTTP retries and timeout are bounded before the first request
    (its defaults, 7 retries of 120 s, would hold a job for minutes), and once tracking
    is off no call reaches the server again."""
    with socket.socket() as closed:  # bound, never listening: connections are refused
        closed.bind(("127.0.0.1", 0))
        uri = f"http://127.0.0.1:{closed.getsockname()[1]}"
        tracker = start_tracking(job(uri, "x"), run_dir=tmp_path)
    assert {name: os.environ[name] for name in HTTP_BOUNDS} == HTTP_BOUNDS
    assert tracker.run_id is None
    assert tracker.error is not None and "\n" not in tracker.error
    assert tracker.error.startswith("mlflow tracking failed at start: MlflowException: ")

    class Unreachable:
        def __getattr__(self, name: str) -> Any:
            raise AssertionError(f"MlflowClient.{name} called after tracking was disabled")

    tracker.client = Unreachable()
    tracker.log_metrics(RECORDS[0], step=10)
    tracker.finish(SUMMARY, failed=False)
    warnings = [line for line in capsys.readouterr().err.splitlines() if "trainstack:" in line]
    assert warnings == [
        f"trainstack: warning: {tracker.error}; training continues without tracking"
    ]


def test_store_broken_mid_run_disables_tracking_without_raising(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = tmp_path / "mlflow.db"
    tracker = start_tracking(job(f"sqlite:///{db}", "broken"), run_dir=tmp_path / "run")
    tracker.log_metrics(RECORDS[0], step=10)
    assert tracker.error is None and tracker.run_id is not None

    db.write_bytes(b"\xff" * db.stat().st_size)  # in place: open connections see it too
    tracker.log_metrics(RECORDS[1], step=20)
    tracker.finish(SUMMARY, failed=False)

    assert tracker.error is not None
    assert tracker.error.startswith("mlflow tracking failed at log_metrics: ")
    assert "file is not a database" in tracker.error
    assert capsys.readouterr().err.count("training continues without tracking") == 1


def test_sqlite_paths_resolve_against_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert resolve_tracking_uri("") == f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert resolve_tracking_uri("sqlite:///db/x.db") == f"sqlite:///{tmp_path / 'db/x.db'}"
    assert resolve_tracking_uri("sqlite:////abs/x.db") == "sqlite:////abs/x.db"
    assert resolve_tracking_uri("http://host:5000") == "http://host:5000"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///env.db")
    assert resolve_tracking_uri("") == f"sqlite:///{tmp_path / 'env.db'}"
