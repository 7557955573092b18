"""Checkpoints in an object store on Ray: `trainstack run` of a DDP job on a real local S3
(moto's server) loses its store mid-run and, once `failure.max_failures` is spent, exits
1 with one line; rerun once the store is back, it resumes from the checkpoint it verified
in S3 and ends bitwise equal to an uninterrupted run with local checkpoints."""

import io
import json
import re
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
import torch
from moto.server import ThreadedMotoServer

from trainstack import checkpoint as ckpt
from trainstack.cli import main
from trainstack.config import config_from_dict
from trainstack.runtime.cluster import worker_env
from trainstack.runtime.gloo_processes import run_processes
from trainstack.runtime.launcher import run_job


class LocalS3:
    """moto's S3 server on 127.0.0.1, on a port its first start bound (port 0: no other
    process can have taken it between a pick and a bind). Stopped, it refuses connections;
    started again, it comes back on that port with the objects it held (they live in this
    process)."""

    def __init__(self) -> None:
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        self.port = self.server.get_host_and_port()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.stop()

    def start_again(self) -> None:
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalS3]:
    """A local S3 with an empty bucket `ckpt`; credentials in the environment (the
    embedded Ray's workers inherit it; a cluster's get them through worker_env)."""
    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(key, value)
    store = LocalS3()
    # moto's objects live in this process across servers: start each test from none.
    reset = urllib.request.Request(f"{store.endpoint}/moto-api/reset", method="POST")
    urllib.request.urlopen(reset)
    boto3.client("s3", endpoint_url=store.endpoint).create_bucket(Bucket="ckpt")
    yield store
    store.stop()


def spec(storage: str, options: dict[str, Any], **faults: object) -> dict[str, Any]:
    return {
        "name": "s3run",
        "model": {"kind": "gpt", "n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 16},
        "data": {"vocab_size": 16, "order": 1, "eval_samples": 16},
        "train": {"steps": 16, "global_batch_size": 16, "micro_batch_size": 8},
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
        "log": {"every_steps": 2, "progress": "quiet"},
        "faults": faults,
    }


class StopsTheStoreAtStep(io.TextIOBase):
    """`trainstack run --progress jsonl`'s standard output, read as it is written: the
    store stops once the record of `step` is printed. (A stop as a checkpoint lands can
    cut Ray Train's own write of its run state, which no restart retries.)"""

    def __init__(self, s3: LocalS3, step: int) -> None:
        self.s3, self.step = s3, step
        self.stopped = False

    def write(self, text: str) -> int:
        for line in text.splitlines():
            if not self.stopped and line.startswith("{") and json.loads(line)["step"] == self.step:
                self.s3.stop()
                self.stopped = True
        return len(text)


def test_a_store_outage_ends_the_run_with_exit_1_and_one_line_and_a_rerun_resumes_bitwise(
    ray_cluster: None,
    s3: LocalS3,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`trainstack run` (here in-process, on the session's Ray) loses its store between
    checkpoints 4 and 8: saving 8 fails (worker failure 1; failure.max_failures=1 allows a
    restart) and the restarted group cannot read the store to resume (failure 2): exit 1,
    one line. Or Ray Train's controller, writing its run state beside the checkpoints,
    meets the outage before any rank (0 worker failures): the same line names the store.
    Rerun once the store is back, it resumes from S3."""
    monkeypatch.chdir(tmp_path)  # the run's local files: .cache/trainstack/runs/s3run
    options = {"endpoint_override": s3.endpoint, "scheme": "http", "region": "us-east-1"}
    raw = spec("s3://ckpt/runs", options, step_delay_s=0.3)  # each step 0.3 s longer
    cfg = config_from_dict(raw)
    assert worker_env(cfg)["AWS_SECRET_ACCESS_KEY"] == "testing"  # creds travel in the env
    job = tmp_path / "job.yaml"
    job.write_text(json.dumps(raw))  # JSON is YAML
    stdout = StopsTheStoreAtStep(s3, 6)
    with monkeypatch.context() as patch:
        patch.setattr(sys, "stdout", stdout)
        assert main(["run", str(job), "--progress", "jsonl"]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if "trainstack" in line]
    print(errors)
    assert stdout.stopped
    assert len(errors) == 1, errors
    assert re.match(r"trainstack: error: training failed after [02] worker failure\(s\)", errors[0])
    assert "s3://ckpt/runs/s3run" in errors[0]
    assert "the checkpoint store did not answer" in errors[0]

    s3.start_again()  # back, with what it held: nothing half-written was taken for done
    run = ckpt.checkpoints_for(cfg)
    last = ckpt.resolve(run).step  # 4, or 8 if the driver heard of step 6 late
    assert last in (4, 8)
    summary = run_job(config_from_dict({**raw, "faults": {}}))  # the same job, at full speed

    assert summary["resumed_from_step"] == last and summary["steps"] == 16
    assert summary["final_checkpoint"] == "s3://ckpt/runs/s3run/checkpoint_00000016"
    assert [p.name for p in ckpt.list_checkpoints(run)] == [ckpt.dir_name(16), ckpt.dir_name(12)]
    final = ckpt.resolve(run)  # verified from the bytes in S3
    assert final.step == 16 and final.path == run / ckpt.dir_name(16)

    reference = config_from_dict({**spec(str(tmp_path / "local"), {}), "name": "reference"})
    run_processes(reference, world_size=2, out_dir=tmp_path / "ref")
    expected = torch.load(tmp_path / "ref" / "model.pt", weights_only=True)
    weights = final.full_weights()
    assert weights.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(weights[name], value), name
