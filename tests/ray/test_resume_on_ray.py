"""Resuming on Ray: `trainstack run --resume-from` another run (on a cluster named by
--address), a rerun of a finished run, a tracking outage."""

import json
import os
import subprocess
import sys
from pathlib import Path

import ray

from trainstack import checkpoint as ckpt
from trainstack.config import config_from_dict
from trainstack.runtime.launcher import run_job
from trainstack.runtime.local import free_port


def spec(tmp_path: Path, *, name: str, steps: int, tracking_uri: str | None = None) -> dict:
    return {
        "name": name,
        "model": {"kind": "gpt", "n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 16},
        "data": {"vocab_size": 16, "order": 1, "eval_samples": 32},
        "train": {"steps": steps, "global_batch_size": 16, "micro_batch_size": 8},
        "optim": {"warmup_steps": 2},
        "scaling": {"num_workers": 2},
        "checkpoint": {"storage_path": str(tmp_path)},
        "tracking": {"backend": "mlflow", "uri": tracking_uri}
        if tracking_uri
        else {"backend": "none"},
        "log": {"every_steps": 5, "progress": "quiet"},
    }


def test_resume_from_another_run_and_rerun_of_a_finished_run(
    ray_cluster: None, tmp_path: Path
) -> None:
    first = config_from_dict(spec(tmp_path, name="first", steps=10))
    done = run_job(first)
    assert done["resumed_from_step"] == 0 and not done.get("already_complete")

    again = run_job(first)  # same name and storage: nothing left to train
    assert again["already_complete"] is True
    assert again["final_loss"] == done["final_loss"]

    # `trainstack run` as a user starts it against a running cluster: this session's,
    # by its address (a second driver; it leaves the cluster up).
    job, summary_json = tmp_path / "second.yaml", tmp_path / "second.json"
    job.write_text(json.dumps(spec(tmp_path, name="second", steps=20)))  # JSON is YAML
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    address = ray.get_runtime_context().gcs_address
    proc = subprocess.run(
        [
            *(str(Path(sys.executable).parent / "trainstack"), "run", str(job)),
            *("--address", address, "--resume-from", str(ckpt.run_dir_for(first))),
            *("--summary-json", str(summary_json), "--progress", "quiet"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    resumed = json.loads(summary_json.read_text())
    assert resumed["resumed_from_step"] == 10 and resumed["steps"] == 20
    # Ray 2.60's words for joining a cluster (a local instance would be "Started ...").
    assert f"Connecting to existing Ray cluster at address: {address}" in proc.stderr
    assert "Started a local Ray instance" not in proc.stderr
    final = ckpt.verify(Path(resumed["final_checkpoint"]))
    assert final.samples_seen == 20 * 16


def test_unreachable_tracking_server_never_stops_training(
    ray_cluster: None, tmp_path: Path
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    summary = run_job(config_from_dict(spec(tmp_path, name="outage", steps=10, tracking_uri=dead)))
    assert summary["steps"] == 10 and summary["final_checkpoint"]
    assert summary["mlflow_run_id"] is None
    assert summary["tracking_error"].startswith("mlflow tracking failed")
