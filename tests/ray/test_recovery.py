"""Worker failures on Ray: group restart + checkpoint restore, measured and bounded."""

from pathlib import Path

import mlflow
import pytest
import torch

from trainstack import checkpoint as ckpt
from trainstack.config import config_from_dict
from trainstack.runtime.launcher import RunFailedError, run_job
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


def test_three_random_worker_kills_end_bitwise_equal_to_an_uninterrupted_run(
    ray_cluster: None, tmp_path: Path
) -> None:
    cfg = config_from_dict(spec(tmp_path, random_kills=3, seed=7))
    summary = run_job(cfg)

    assert summary["restarts"] == 3
    every = cfg.checkpoint.every_steps
    assert all(0 <= r["steps_lost"] < every for r in summary["recovery"]), summary["recovery"]

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


def test_run_fails_with_a_clear_summary_after_max_failures(
    ray_cluster: None, tmp_path: Path
) -> None:
    raw = spec(tmp_path, kill_at_steps=[3, 6], rank=1)
    raw["failure"] = {"max_failures": 1}
    raw["tracking"] = {"backend": "none"}
    with pytest.raises(RunFailedError) as failed:
        run_job(config_from_dict(raw))
    message = str(failed.value)
    assert message.startswith("training failed after 2 worker failure(s)")
    assert "last error:" in message
