"""The demo job trains through a Ray Train worker group down to the data's entropy floor,
on the layout `strategy.kind: auto` picks for it (DDP), said in the summary and MLflow; a
group that finds no room is tried `failure.max_failures` more times, then the run ends."""

import io
import json
import os
from pathlib import Path
from typing import Any

import pytest
from ray.train.v2._internal.constants import WORKER_GROUP_START_TIMEOUT_S_ENV_VAR

from trainstack.config import load_config
from trainstack.runtime.launcher import RunFailedError, run_job
from trainstack.runtime.progress import ProgressDisplay

ROOT = Path(__file__).resolve().parents[2]


def test_demo_variant_reaches_entropy_floor_on_two_workers(
    ray_cluster: None, tmp_path: Path
) -> None:
    cfg = load_config(
        str(ROOT / "jobs/configs/demo.yaml"),
        [
            "name=demo-short",
            "train.steps=120",
            "data.vocab_size=16",
            "data.order=1",
            "log.every_steps=20",
            f"checkpoint.storage_path={tmp_path}",
            "strategy.kind=auto",  # the plan picks DDP for a model this small
            "tracking.backend=mlflow",
            f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}",
        ],
    )
    stream = io.StringIO()
    summary = run_job(cfg, display=ProgressDisplay(mode="jsonl", stream=stream))

    assert summary["world_size"] == 2 and summary["strategy"] == "ddp"
    choice = summary["strategy_choice"]
    assert choice.startswith("strategy.kind=auto chose ddp 2 (strategy.kind=ddp")
    import mlflow

    run = mlflow.MlflowClient(tracking_uri=cfg.tracking.uri).get_run(summary["mlflow_run_id"])
    assert run.data.tags["trainstack.strategy_choice"] == choice
    assert run.data.params["strategy.kind"] == "ddp"
    assert summary["steps"] == 120
    floor = summary["entropy_floor"]
    assert 0 < floor < summary["final_loss"] <= 1.10 * floor
    # Throughput counts the global batch (every worker's tokens) over the steady state's
    # mean step, which the steps after warm-up take no more than the whole training time.
    samples, tokens = cfg.train.global_batch_size, cfg.train.global_batch_size * 64
    step_s = summary["step_time_s"]
    assert summary["tokens_per_s"] == pytest.approx(tokens / step_s, rel=1e-9)
    assert summary["samples_per_s"] == pytest.approx(samples / step_s, rel=1e-9)
    assert 0 < step_s * (cfg.train.steps - 3) < summary["train_s"] < summary["wall_s"]
    assert summary["mfu"] is None  # CPU: no known peak FLOP/s
    # Start-up, part by part, adds up to the time to the first step, within the run's
    # wall time (one machine: the driver's and the workers' clocks agree).
    startup = summary["startup"]
    parts = ("checks_s", "ray_connect_s", "worker_group_start_s", "model_build_s", "first_step_s")
    assert all(startup[part] >= 0 for part in parts), startup
    assert sum(startup[part] for part in parts) == pytest.approx(startup["to_first_step_s"])
    assert summary["time_to_first_step_s"] == startup["to_first_step_s"] < summary["wall_s"]
    assert startup["worker_group_start_s"] > 0.5  # the group's processes start and import torch

    records = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [r["step"] for r in records] == [20, 40, 60, 80, 100, 120]
    assert records[-1]["loss"] < records[0]["loss"]
    for r in records:  # each window: the global batch's tokens over its mean step
        assert r["tokens_per_s"] == pytest.approx(tokens / r["step_time_s"], rel=1e-9)
        assert r["peak_mem_bytes"] > 0


@pytest.mark.timeout(120)  # without the start timeout the run would wait for room forever
def test_workers_that_find_no_room_end_the_run_after_max_failures_plus_1_start_attempts(
    ray_cluster: None, tmp_path: Path
) -> None:
    # The session's Ray instance has 4 CPUs: 8 one-CPU workers never fit.
    cfg = load_config(
        str(ROOT / "jobs/configs/demo.yaml"),
        [
            "name=no-room",
            "scaling.num_workers=8",
            "scaling.start_timeout_s=1",
            "failure.max_failures=2",
            "train.global_batch_size=16",
            "train.micro_batch_size=2",
            f"checkpoint.storage_path={tmp_path}",
            "tracking.backend=none",
        ],
    )
    attempts: list[dict[str, Any]] = []

    def count_attempts(record: dict[str, Any]) -> None:
        if record.get("event") == "start_attempt":
            attempts.append(record)

    with pytest.raises(RunFailedError) as failed:
        run_job(cfg, on_record=count_attempts)
    assert str(failed.value).startswith(
        "the cluster did not make room for scaling.num_workers=8 (8 CPU) within "
        "scaling.start_timeout_s=1 s;"
    )
    assert "\n" not in str(failed.value)
    # Each attempt waits start_timeout_s; failure.max_failures more follow the first.
    assert [a["workers"] for a in attempts] == [8, 8, 8]
    assert WORKER_GROUP_START_TIMEOUT_S_ENV_VAR not in os.environ  # restored after the fit
