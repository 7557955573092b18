"""Resuming on Ray: --resume-from another run, a rerun of a finished run, a tracking outage."""

from pathlib import Path

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

    second = config_from_dict(spec(tmp_path, name="second", steps=20))
    resumed = run_job(second, resume_from=ckpt.run_dir_for(first))
    assert resumed["resumed_from_step"] == 10 and resumed["steps"] == 20
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
