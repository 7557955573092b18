"""Resuming on Ray: `trainstack run` against a running cluster (--address), starting from
another run (--resume-from), whose driver is killed mid-run, is recovered by running the
same command again, in the same MLflow run; once finished, it trains nothing again.
(A tracking server that does not answer: `test_text_on_ray`.)"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import mlflow
import pytest
import ray

from trainstack import checkpoint as ckpt
from trainstack.config import config_from_dict
from trainstack.runtime.gloo_processes import run_processes
from trainstack.runtime.launcher import run_job


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


class Driver:
    """`trainstack run ... --progress jsonl` in a process of its own: the steps it has
    heard of, read from its output as it goes."""

    def __init__(self, command: list[str], *, env: dict[str, str], log: Path) -> None:
        self.log = log
        with log.open("w") as stderr:
            self.process = subprocess.Popen(
                command, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True
            )
        self.steps: list[int] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith("{"):
                self.steps.append(json.loads(line)["step"])

    def alive(self) -> bool:
        return self.process.poll() is None


def own_checkpoint(run_dir: Path) -> ckpt.Checkpoint | None:
    """The run's newest checkpoint that verifies (one being written does not)."""
    return ckpt.latest_valid(run_dir, warn=lambda _: None)[0]


@pytest.mark.timeout(400)  # each wait below is for something the run does by itself
def test_a_killed_driver_is_recovered_by_running_the_same_command_again(
    ray_cluster: None, tmp_path: Path
) -> None:
    # Another run's checkpoint to start from (--resume-from): 10 steps in this process.
    first = spec(tmp_path, name="first", steps=10)
    first["scaling"] = {"num_workers": 1}
    run_processes(config_from_dict(first), world_size=1, out_dir=tmp_path / "first-out")
    every, steps = 5, 30
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    raw = spec(tmp_path, name="second", steps=steps, tracking_uri=uri)
    raw["checkpoint"]["every_steps"] = every
    raw["faults"] = {"step_delay_s": 0.15}  # time to kill the driver before the run ends
    job, summary_json = tmp_path / "second.yaml", tmp_path / "second.json"
    job.write_text(json.dumps(raw))  # JSON is YAML
    run_dir = ckpt.run_dir_for(config_from_dict(raw))
    # `trainstack run` as a user starts it against a running cluster: this session's, by
    # its address (a second driver; the cluster stays up when it dies).
    address = ray.get_runtime_context().gcs_address
    command = [
        *(str(Path(sys.executable).parent / "trainstack"), "run", str(job)),
        *("--address", address, "--resume-from", str(tmp_path / "first")),
        *("--summary-json", str(summary_json), "--progress", "jsonl"),
    ]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}

    # The driver dies (SIGKILL: no clean-up of any kind) once the run has a checkpoint of
    # its own and the driver has logged the step it holds.
    driver = Driver(command, env=env, log=tmp_path / "killed.log")
    while True:
        assert driver.alive(), driver.log.read_text()[-3000:]
        saved = own_checkpoint(run_dir)
        if saved is not None and driver.steps and driver.steps[-1] >= saved.step:
            break
        time.sleep(0.05)
    driver.process.send_signal(signal.SIGKILL)
    driver.process.wait()
    heard = driver.steps[-1]
    assert 10 < saved.step <= heard < steps, (saved.step, heard)
    # Ray ends the dead driver's job: its worker group goes and the CPUs come free.
    while ray.available_resources().get("CPU") != ray.cluster_resources()["CPU"]:
        time.sleep(0.1)

    rerun = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    assert rerun.returncode == 0, rerun.stdout[-2000:] + rerun.stderr[-2000:]
    # Ray 2.60's words for joining a cluster (a local instance would be "Started ...").
    assert f"Connecting to existing Ray cluster at address: {address}" in rerun.stderr
    assert "Started a local Ray instance" not in rerun.stderr
    summary: dict[str, Any] = json.loads(summary_json.read_text())
    # From its own newest checkpoint, not --resume-from's step 10: at most `every` lost.
    assert summary["resumed_from_step"] >= saved.step > 10
    assert heard - summary["resumed_from_step"] <= every
    final = ckpt.verify(Path(summary["final_checkpoint"]))
    assert final.step == steps and final.samples_seen == steps * 16

    client = mlflow.MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(config_from_dict(raw).tracking.experiment)
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1, [r.info.run_id for r in runs]  # one run for the job, continued
    run = runs[0]
    assert run.info.run_id == summary["mlflow_run_id"] and run.info.status == "FINISHED"
    assert run.data.tags["trainstack.resumed_count"] == "1"
    # Step 15 reached MLflow from the killed driver only (the rerun starts after it).
    logged = {m.step for m in client.get_metric_history(run.info.run_id, "loss")}
    assert logged == set(range(15, steps + 1, every))

    again = run_job(config_from_dict(raw))  # once more: nothing left to train, Ray not started
    assert again["already_complete"] is True
    assert again["final_loss"] == summary["final_loss"]
