"""The demo job trains through a Ray Train worker group down to the data's entropy floor,
on the layout `strategy.kind: auto` picks for it (DDP), said in the summary and MLflow."""

import io
import json
import os
import time
from pathlib import Path

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
    assert summary["tokens_per_s"] > 0 and summary["samples_per_s"] > 0
    assert summary["mfu"] is None  # CPU: no known peak FLOP/s
    assert summary["wall_s"] > summary["train_s"] > 0

    records = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [r["step"] for r in records] == [20, 40, 60, 80, 100, 120]
    assert records[-1]["loss"] < records[0]["loss"]
    assert all(r["tokens_per_s"] > 0 and r["peak_mem_bytes"] > 0 for r in records)


def test_workers_that_find_no_room_end_the_run_after_start_timeout_s(
    ray_cluster: None, tmp_path: Path
) -> None:
    # The session's Ray instance has 4 CPUs: 8 one-CPU workers never fit.
    cfg = load_config(
        str(ROOT / "jobs/configs/demo.yaml"),
        [
            "name=no-room",
            "scaling.num_workers=8",
            "scaling.start_timeout_s=1",
            "train.global_batch_size=16",
            "train.micro_batch_size=2",
            f"checkpoint.storage_path={tmp_path}",
            "tracking.backend=none",
        ],
    )
    started = time.perf_counter()
    with pytest.raises(RunFailedError) as failed:
        run_job(cfg)
    assert str(failed.value).startswith(
        "the cluster did not make room for scaling.num_workers=8 (8 CPU) within "
        "scaling.start_timeout_s=1 s;"
    )
    assert time.perf_counter() - started < 60
    assert WORKER_GROUP_START_TIMEOUT_S_ENV_VAR not in os.environ  # restored after the fit
