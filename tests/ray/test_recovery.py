"""Worker failures on Ray: group restart + checkpoint restore, measured and bounded."""

import json
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
from trainstack.runtime.launcher import run_job
from trainstack.runtime.local import run_processes


def spec(tmp_path: Path, **faults: object) -> dict:
    return {
        "name": "chaos",
        "model": {"kind": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16},
        "data": {"vocab_size": 16, "order": 1, "eval_samples": 32},
        "train": {"steps": 30, "global_batch_size": 16, "micro_batch_size": 8},
        "optim": {"lr": 1e-2, "warmup_steps": 2},
        "scaling": {"num_workers": 2},
        "checkpoint": {"every_steps": 4, "storage_path": str(tmp_path / "runs")},
        "failure": {"max_failures": 3},
        "tracking": {"backend": "mlflow", "uri": f"sqlite:///{tmp_path}/mlflow.db"},
        "log": {"every_steps": 2, "progress": "quiet"},
        "faults": faults,
    }


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


def test_worker_kills_from_outside_and_injected_end_bitwise_equal_to_an_uninterrupted_run(
    ray_cluster: None, tmp_path: Path
) -> None:
    # Injected kills before steps 20 and 27; before those, a worker is SIGKILLed from
    # outside as soon as the driver hears of step 2, as an OOM killer or an operator would.
    cfg = config_from_dict(spec(tmp_path, random_kills=2, seed=6))
    killed: list[int] = []

    def kill_once(record: dict[str, Any]) -> None:
        if killed or record.get("step") != 2 or "event" in record:
            return
        pids = train_worker_pids()
        assert pids, "no Ray Train worker process found"
        os.kill(pids[-1], signal.SIGKILL)
        killed.append(pids[-1])

    summary = run_job(cfg, on_record=kill_once)

    assert killed and summary["restarts"] == 3
    every = cfg.checkpoint.every_steps
    outside, *injected = summary["recovery"]
    # From outside, the lost steps are counted from the last step the driver heard of
    # (>= 2) and are fewer than `every` unless the kill cut the upload of a checkpoint
    # short, which the restart then skips: `every` steps lost at most.
    assert outside["failed_after_step"] >= 2, summary["recovery"]
    assert 0 <= outside["steps_lost"] <= every, summary["recovery"]
    assert injected == [
        {"resumed_from_step": 16, "failed_after_step": 19, "steps_lost": 3},
        {"resumed_from_step": 24, "failed_after_step": 26, "steps_lost": 2},
    ]

    reference_cfg = config_from_dict({**spec(tmp_path / "ref"), "faults": {}})
    run_processes(reference_cfg, world_size=2, out_dir=tmp_path / "ref")
    reference = torch.load(tmp_path / "ref" / "model.pt", weights_only=True)
    final = ckpt.verify(Path(summary["final_checkpoint"]))
    assert final.step == 30
    weights = final.load("model.pt")
    for name, value in reference.items():
        assert torch.equal(weights[name], value), name

    client = mlflow.MlflowClient(tracking_uri=cfg.tracking.uri)
    experiment = client.get_experiment_by_name(cfg.tracking.experiment)
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1 and runs[0].info.run_id == summary["mlflow_run_id"]
    assert runs[0].info.status == "FINISHED"
    logged = [m.step for m in client.get_metric_history(summary["mlflow_run_id"], "loss")]
    assert set(logged) == set(range(2, 31, 2))


def test_run_fails_with_exit_1_and_a_clear_line_after_max_failures(
    ray_cluster: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`trainstack run` (here in-process, on the session's Ray) of a job whose worker dies
    once more than `failure.max_failures` allows."""
    raw = spec(tmp_path, kill_at_steps=[3, 6], rank=1)
    raw["failure"] = {"max_failures": 1}
    raw["tracking"] = {"backend": "none"}
    job = tmp_path / "job.yaml"
    job.write_text(json.dumps(raw))  # JSON is YAML
    assert main(["run", str(job), "--progress", "quiet"]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if "trainstack" in line]
    assert len(errors) == 1, errors
    assert errors[0].startswith("trainstack: error: training failed after 2 worker failure(s)")
    assert "; last error: " in errors[0]
