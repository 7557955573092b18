"""A worker killed from outside on Ray, under fsdp with tensor parallelism: a tp2 × dp2
group whose worker is SIGKILLed (as an OOM killer or an operator would) restarts from its
sharded checkpoint (every rank's DCP shards, collected by Ray Train into one checkpoint),
ends where one process ends (in float64, `tests/bounds.py`), keeps one MLflow run, and
the checkpoint exports those whole weights. (One failure more than
`failure.max_failures` ends a run with exit 1 and one line: `test_object_store`; an
injected kill's exact accounting: `test_ray_data_source`.)"""

import os
import signal
from pathlib import Path
from typing import Any

import mlflow
import psutil
import pytest
import torch

from trainstack import checkpoint as ckpt
from trainstack.cli import main
from trainstack.config import config_from_dict
from trainstack.models import build_model
from trainstack.runtime.launcher import run_job

from bounds import FP64_BOUND, assert_trained, held_out_loss, max_difference, one_process


def train_worker_pids() -> list[int]:
    """This session's Ray Train worker processes (descendants of this process, so never
    another Ray instance's on the same machine)."""
    pids = []
    for process in psutil.Process().children(recursive=True):
        try:
            if process.cmdline()[:1] and process.cmdline()[0].startswith("ray::RayTrainWorker"):
                pids.append(process.pid)
        except psutil.Error:  # exited meanwhile
            continue
    return pids


@pytest.mark.slow
def test_tp2_dp2_survives_a_worker_killed_from_outside_and_exports_what_one_process_trains(
    ray_cluster: None, tmp_path: Path
) -> None:
    raw = {
        "name": "tp2xdp2-chaos",
        "model": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16},
        "data": {"vocab_size": 16, "order": 1, "eval_samples": 32},
        "train": {"steps": 12, "global_batch_size": 16, "micro_batch_size": 8, "precision": "fp64"},
        "optim": {"lr": 1e-2, "warmup_steps": 2},
        "strategy": {"kind": "fsdp", "tensor_parallel": 2},
        "scaling": {"num_workers": 4},
        "checkpoint": {"every_steps": 4, "storage_path": str(tmp_path / "runs")},
        "failure": {"max_failures": 1},
        "tracking": {"backend": "mlflow", "uri": f"sqlite:///{tmp_path}/mlflow.db"},
        "log": {"every_steps": 2, "progress": "quiet"},
    }
    cfg = config_from_dict(raw)
    killed: list[int] = []

    def kill_once(record: dict[str, Any]) -> None:
        # As soon as the driver hears of step 6 (after checkpoint 4).
        if killed or record.get("step") != 6 or "event" in record:
            return
        pids = train_worker_pids()
        assert len(pids) == 4, f"Ray Train worker processes: {pids}"
        os.kill(pids[-1], signal.SIGKILL)
        killed.append(pids[-1])

    summary = run_job(cfg, on_record=kill_once)
    assert killed and summary["restarts"] == 1 and summary["strategy"] == "fsdp"
    every = cfg.checkpoint.every_steps
    [recovery] = summary["recovery"]
    # From outside, the lost steps are counted from the last step the driver heard of
    # (>= 6) and are fewer than `every` unless the kill cut the save of a checkpoint
    # short, which the restart then skips: `every` steps lost at most. The restart
    # restored checkpoint 4 (or 8, had the driver heard of step 6 late).
    assert recovery["resumed_from_step"] in (4, 8), recovery
    assert recovery["failed_after_step"] >= 6, recovery
    assert 0 <= recovery["steps_lost"] <= every, recovery
    final = ckpt.resolve(ckpt.run_dir_for(cfg))
    assert final.step == 12
    shards = [name for name in final.manifest["files"] if name.startswith("state/__")]
    assert len(shards) == 4 and final.has("state/.metadata")  # every rank's, verified

    exported = tmp_path / "model.pt"
    assert main(["export", str(ckpt.run_dir_for(cfg)), "--out", str(exported)]) == 0
    weights = torch.load(exported, weights_only=True)
    build_model(cfg.model, vocab_size=cfg.data.vocab_size, seed=0).load_state_dict(weights)
    # The kill, the resume from every rank's shards and the export change nothing: the
    # weights are one process's (a skipped shard, a wrong offset or a lost optimizer state
    # moves them by 1e-4 or more in as many steps), and the run evaluated those weights.
    reference = one_process({**raw, "tracking": {"backend": "none"}}, tmp_path / "reference")
    diff = max_difference(weights, reference)
    print(f"max |tp2 x dp2 on Ray, killed once - one process| = {diff:.3g}")
    assert diff < FP64_BOUND
    assert_trained(reference, raw)
    assert summary["eval_loss"] == pytest.approx(held_out_loss(raw, weights), rel=1e-9)

    # One MLflow run for the job across the restart, finished, with every logged step.
    client = mlflow.MlflowClient(tracking_uri=cfg.tracking.uri)
    experiment = client.get_experiment_by_name(cfg.tracking.experiment)
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1 and runs[0].info.run_id == summary["mlflow_run_id"]
    assert runs[0].info.status == "FINISHED"
    logged = [m.step for m in client.get_metric_history(summary["mlflow_run_id"], "loss")]
    assert set(logged) == set(range(2, cfg.train.steps + 1, 2))
