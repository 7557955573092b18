"""A group that finds no room is tried `failure.max_failures` more times, then the run
ends with one line. (What a worker group's run reports, `strategy.kind: auto`'s choice
included: `test_text_on_ray`.)"""

import os
from pathlib import Path
from typing import Any

import pytest

from trainstack.config import load_config
from trainstack.runtime.capacity import HEALTH_CHECK_INTERVAL_ENV, WORKER_GROUP_START_TIMEOUT_ENV
from trainstack.runtime.launcher import RunFailedError, run_job

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)  # without the start timeout the run would wait for room forever
def test_workers_that_find_no_room_end_the_run_after_max_failures_plus_1_start_attempts(
    ray_cluster: None, tmp_path: Path
) -> None:
    # The session's Ray instance has 4 CPUs: 8 one-CPU workers never fit.
    cfg = load_config(
        str(ROOT / "jobs/configs/demo.yaml"),
        [
            "name=no-room",
            "scaling.num_workers=8",
            "scaling.start_timeout_s=1",
            "failure.max_failures=2",
            "train.global_batch_size=16",
            "train.micro_batch_size=2",
            f"checkpoint.storage_path={tmp_path}",
            "tracking.backend=none",
        ],
    )
    attempts: list[dict[str, Any]] = []

    def count_attempts(record: dict[str, Any]) -> None:
        if record.get("event") == "start_attempt":
            attempts.append(record)

    with pytest.raises(RunFailedError) as failed:
        run_job(cfg, on_record=count_attempts)
    assert str(failed.value).startswith(
        "the cluster did not make room for scaling.num_workers=8 (8 CPU) within "
        "scaling.start_timeout_s=1 s;"
    )
    assert "\n" not in str(failed.value)
    # Each attempt waits start_timeout_s; failure.max_failures more follow the first.
    assert [a["workers"] for a in attempts] == [8, 8, 8]
    assert WORKER_GROUP_START_TIMEOUT_ENV not in os.environ  # restored after the fit
    assert HEALTH_CHECK_INTERVAL_ENV not in os.environ  # the spec's, for the fit only
