"""`ray job submit` of jobs/train.py against a `ray start --head` cluster on 127.0.0.1."""

import json
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainstack.runtime.local import free_port

from user_shell import BIN, run

pytestmark = pytest.mark.slow


@pytest.fixture
def auth() -> dict[str, str]:
    """Token authentication, as a secured cluster runs: every command carries the token."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}


@pytest.fixture
def head_node(auth: dict[str, str]) -> Iterator[str]:
    """A one-node Ray cluster on loopback; yields the job API address. Stopped by `ray stop`."""
    gcs_port, dashboard_port = free_port(), free_port()
    started = run(
        [
            str(BIN / "ray"),
            "start",
            "--head",
            "--node-ip-address=127.0.0.1",
            f"--port={gcs_port}",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dashboard_port}",
            "--num-cpus=2",
            "--disable-usage-stats",
        ],
        timeout=180,
        **auth,
    )
    assert started.returncode == 0, started.stderr[-3000:]
    try:
        yield f"http://127.0.0.1:{dashboard_port}"
    finally:
        stopped = run([str(BIN / "ray"), "stop"], timeout=120, **auth)
        assert stopped.returncode == 0, stopped.stderr[-2000:]


def test_job_submit_trains_demo_on_head_node(
    head_node: str, auth: dict[str, str], tmp_path: Path
) -> None:
    summary_path = tmp_path / "summary.json"
    proc = run(
        [
            str(BIN / "ray"),
            "job",
            "submit",
            "--address",
            head_node,
            "--working-dir",
            ".",
            "--",
            "python",
            "jobs/train.py",
            "--config",
            "jobs/configs/demo.yaml",
            "--set",
            "train.steps=30",
            "--set",
            f"checkpoint.storage_path={tmp_path / 'runs'}",
            "--summary-json",
            str(summary_path),
            "--progress",
            "lines",
        ],
        timeout=420,
        **auth,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "succeeded" in proc.stdout
    assert "step 30/30" in proc.stdout
    summary = json.loads(summary_path.read_text())
    assert summary["steps"] == 30 and summary["world_size"] == 2
    assert summary["final_loss"] < summary["entropy_floor"] * 2
