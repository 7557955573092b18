"""Checkpoints in an object store on Ray: a DDP run on a real local S3 (moto's server)
loses a worker, resumes from the checkpoint it verified in S3, and ends bitwise equal to
an uninterrupted run with local checkpoints."""

import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
import torch
from moto.server import ThreadedMotoServer

from trainstack import checkpoint as ckpt
from trainstack.config import config_from_dict
from trainstack.runtime.launcher import RunFailedError, run_job, worker_env
from trainstack.runtime.local import free_port, run_processes


@pytest.fixture
def s3_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[ThreadedMotoServer]:
    """A local S3 (moto's server on 127.0.0.1) with an empty bucket `ckpt`; credentials
    in the environment (the embedded Ray's workers inherit it; a cluster's get them
    through worker_env). Stopped and started again, it keeps its objects (they live in
    this process)."""
    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(key, value)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{server.get_host_and_port()[1]}"
    # moto's objects live in this process across servers: start each test from none.
    urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST"))
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="ckpt")
    yield server
    server.stop()


@pytest.fixture
def s3(s3_server: ThreadedMotoServer) -> dict[str, Any]:
    """storage_options of the local S3."""
    endpoint = f"http://127.0.0.1:{s3_server.get_host_and_port()[1]}"
    return {"endpoint_override": endpoint, "scheme": "http", "region": "us-east-1"}


def spec(storage: str, options: dict[str, Any], **faults: object) -> dict[str, Any]:
    return {
        "name": "s3run",
        "model": {"kind": "gpt", "n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 16},
        "data": {"vocab_size": 16, "order": 1, "eval_samples": 16},
        "train": {"steps": 12, "global_batch_size": 16, "micro_batch_size": 8},
        "optim": {"lr": 1e-2, "warmup_steps": 2},
        "scaling": {"num_workers": 2},
        "checkpoint": {
            "every_steps": 4,
            "keep": 2,
            "storage_path": storage,
            "storage_options": options,
        },
        "failure": {"max_failures": 1},
        "tracking": {"backend": "none"},
        "log": {"every_steps": 4, "progress": "quiet"},
        "faults": faults,
    }


def test_ddp_run_killed_resumes_from_s3_and_ends_bitwise_equal_to_an_uninterrupted_run(
    ray_cluster: None, s3: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # the run's local files: .cache/trainstack/runs/s3run
    cfg = config_from_dict(spec("s3://ckpt/runs", s3, kill_at_steps=[7], rank=1))
    assert worker_env(cfg)["AWS_SECRET_ACCESS_KEY"] == "testing"  # creds travel in the env

    summary = run_job(cfg)

    assert summary["restarts"] == 1
    assert summary["recovery"] == [
        {"resumed_from_step": 4, "failed_after_step": 6, "steps_lost": 2}
    ]
    assert summary["final_checkpoint"] == "s3://ckpt/runs/s3run/checkpoint_00000012"
    run = ckpt.checkpoints_for(cfg)
    assert [p.name for p in ckpt.list_checkpoints(run)] == [ckpt.dir_name(12), ckpt.dir_name(8)]
    assert (tmp_path / ".cache/trainstack/runs/s3run/faults").is_dir()  # local, not in S3
    final = ckpt.resolve(run)  # verified from the bytes in S3
    assert final.step == 12 and final.path == run / ckpt.dir_name(12)

    reference = config_from_dict({**spec(str(tmp_path / "local"), {}), "name": "reference"})
    run_processes(reference, world_size=2, out_dir=tmp_path / "ref")
    expected = torch.load(tmp_path / "ref" / "model.pt", weights_only=True)
    weights = final.full_weights()
    assert weights.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(weights[name], value), name


def test_a_store_outage_ends_the_run_with_one_line_and_a_rerun_resumes_once_it_is_back(
    ray_cluster: None,
    s3_server: ThreadedMotoServer,
    s3: dict[str, Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    raw = spec("s3://ckpt/runs", s3)
    raw["train"]["steps"] = 16
    raw["log"]["every_steps"] = 2
    raw["faults"] = {"step_delay_s": 0.5}  # the outage begins between checkpoints 4 and 8
    stopped: list[int] = []

    def stop_the_store(record: dict[str, Any]) -> None:
        if not stopped and record.get("step") == 6:
            stopped.append(6)
            s3_server.stop()

    with pytest.raises(RunFailedError) as failed:
        run_job(config_from_dict(raw), on_record=stop_the_store)
    message = str(failed.value)
    print(message)
    assert stopped == [6]
    assert "\n" not in message and message.startswith("training failed after 2 worker failure(s)")
    assert "the checkpoint store did not answer" in message

    s3_server.start()  # back, with what it held: nothing half-written was taken for done
    cfg = config_from_dict({**raw, "faults": {}})
    run = ckpt.checkpoints_for(cfg)
    last = ckpt.resolve(run).step  # 4, or 8 if the driver heard of step 6 late
    assert last in (4, 8)
    summary = run_job(cfg)
    assert summary["resumed_from_step"] == last and summary["steps"] == 16

    reference = {**spec(str(tmp_path / "local"), {}), "name": "reference"}
    reference["train"]["steps"] = 16
    run_processes(config_from_dict(reference), world_size=2, out_dir=tmp_path / "ref")
    expected = torch.load(tmp_path / "ref" / "model.pt", weights_only=True)
    weights = ckpt.resolve(run).full_weights()
    for name, value in expected.items():
        assert torch.equal(weights[name], value), name
