"""The driver without Ray: what it makes of a run's events, and what `trainstack run`
refuses before Ray starts."""

import json
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest
import ray.train

from trainstack import checkpoint as ckpt
from trainstack.cli import main as cli_main
from trainstack.config import config_from_dict, config_to_dict
from trainstack.observe.tracking import NullTracker
from trainstack.runtime.events import RunFollower
from trainstack.runtime.launcher import _failure_summary
from trainstack.storage import StorePath


def follow(*events: dict[str, Any]) -> list[dict[str, Any]]:
    follower = RunFollower(display=None, tracker=NullTracker())
    for event in events:
        follower.handle(event)
    return follower.recovery()


def start(resumed: int) -> dict[str, Any]:
    return {"event": "start", "resumed_from_step": resumed, "world_size": 2, "notes": []}


def logged(*steps: int) -> list[dict[str, Any]]:
    return [{"step": step, "loss": 1.0} for step in steps]


FAILURE = {"event": "failure", "rank": 1, "error": "ActorDiedError: killed", "time": 0.0}


def test_steps_lost_after_a_crash_nobody_injected_come_from_the_last_logged_step() -> None:
    # Checkpoints every 4 steps, logs every 2: the group died after logging step 6.
    recovery = follow(start(0), *logged(2, 4, 6), FAILURE, start(4), *logged(6, 8))
    assert recovery == [{"resumed_from_step": 4, "failed_after_step": 6, "steps_lost": 2}]


def test_each_restart_is_matched_with_its_own_failure() -> None:
    recovery = follow(
        start(0),
        *logged(2, 4, 6),
        FAILURE,  # a process killed from outside
        start(4),
        {"event": "first_step", "step": 5, "time": 0.0},
        FAILURE,  # before the restarted group logged anything: it had finished step 5
        start(4),
        FAILURE,  # before this group finished a step
        start(4),
        *logged(6, 8),
        {"event": "fault", "step": 10, "rank": 1, "time": 0.0},  # injected: exact
        FAILURE,
        start(8),
        *logged(10, 12),
    )
    assert recovery == [
        {"resumed_from_step": 4, "failed_after_step": 6, "steps_lost": 2},
        {"resumed_from_step": 4, "failed_after_step": 5, "steps_lost": 1},
        {"resumed_from_step": 4, "failed_after_step": 4, "steps_lost": 0},
        {"resumed_from_step": 8, "failed_after_step": 9, "steps_lost": 1},
    ]


def spec(storage: Path, **strategy: Any) -> dict[str, Any]:
    clip = {"grad_clip": 0.0} if strategy.get("kind") == "ps" else {}
    return {
        "name": "demo",
        "model": {"kind": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 8},
        "data": {"vocab_size": 16, "eval_samples": 8},
        "train": {"steps": 10, "global_batch_size": 16, "micro_batch_size": 8},
        "optim": {"warmup_steps": 2, **clip},
        "strategy": strategy,
        "checkpoint": {"storage_path": str(storage)},
        "log": {"progress": "quiet"},
    }


def run_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], raw: dict[str, Any], *args: str
) -> tuple[int, list[str]]:
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(json.dumps(raw))  # JSON is YAML
    code = cli_main(["run", str(spec_file), *args])
    return code, capsys.readouterr().err.strip().splitlines()


def finished_run(raw: dict[str, Any]) -> Path:
    """A finished run's checkpoint (a manifest, no files) written under spec `raw`."""
    final = ckpt.run_dir_for(config_from_dict(raw)) / ckpt.dir_name(10)
    final.mkdir(parents=True)
    manifest = {"format": 1, "step": 10, "samples_seen": 160, "files": {}, "metrics": {}}
    ckpt.write_manifest(final, {**manifest, "spec": config_to_dict(config_from_dict(raw))})
    return final


def test_rerun_of_a_finished_run_with_another_strategy_exits_2_before_ray_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], refuse_ray_start: None
) -> None:
    raw = spec(tmp_path / "runs")
    finished_run(raw)
    code, errors = run_cli(tmp_path, capsys, raw, "--set", "strategy.kind=zero")
    assert code == 2 and len(errors) == 1
    assert "run 'demo' already has a checkpoint at step 10 (finished)" in errors[0]
    assert "strategy.kind 'ddp' → 'zero'" in errors[0]


def test_resume_from_with_the_parameter_server_exits_2_before_ray_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], refuse_ray_start: None
) -> None:
    source = finished_run(spec(tmp_path / "source"))
    raw = spec(tmp_path / "runs", kind="ps", num_shards=2)
    code, errors = run_cli(tmp_path, capsys, raw, "--resume-from", str(source))
    assert code == 2 and len(errors) == 1
    assert "strategy.kind=ps cannot start from a checkpoint" in errors[0]
    assert not (tmp_path / "runs").exists()


def test_every_event_comes_back_from_its_record_as_it_was_sent() -> None:
    from trainstack.run_events import EVENTS, CompressionChange, Start, event_of

    sent = [
        Start(resumed_from_step=4, world_size=2, notes=["fsdp 2"], worker_entered=1.0),
        CompressionChange(step=7, ratio=0.01, reason="slow link"),
    ]
    for event in sent:
        record = json.loads(json.dumps(event.to_record()))  # as the JSON-lines harness has it
        assert record["event"] == event.name and EVENTS[event.name] is type(event)
        assert event_of(record) == event
    assert event_of({"step": 3, "loss": 1.0}) is None  # a log record


def test_start_up_is_split_where_the_driver_and_the_first_group_said_each_part_ended() -> None:
    from trainstack.run_events import FirstStep, Start

    follower = RunFollower(display=None, tracker=NullTracker())
    assert follower.startup(began=100.0, checked=101.0, connected=104.0) is None
    first = Start(resumed_from_step=0, world_size=2, worker_entered=109.0, time=111.5)
    follower.handle(first.to_record())
    follower.handle(FirstStep(step=1, time=114.0).to_record())
    follower.handle(Start(resumed_from_step=0, world_size=2, worker_entered=130.0).to_record())
    follower.handle(FirstStep(step=1, time=140.0).to_record())  # a restart's: not start-up
    assert follower.startup(began=100.0, checked=101.0, connected=104.0) == {
        "checks_s": 1.0,
        "ray_connect_s": 3.0,
        "worker_group_start_s": 5.0,
        "model_build_s": 2.5,
        "first_step_s": 2.5,
        "to_first_step_s": 14.0,
    }


def test_goodput_splits_the_wall_time_into_steps_stalls_restarts_and_replayed_work() -> None:
    """A run of 12 s of steps checkpointed every 4 steps, whose group died after step 6
    and resumed from 4: the 2 steps done twice (at the failed group's 0.5 s a step) are
    replayed, not steps; the failure to the new group's first step is the restart."""
    from trainstack.run_events import Failure, FirstStep, Start

    follower = RunFollower(display=None, tracker=NullTracker())
    spent = {"time_eval_s": 0.5, "time_checkpoint_s": 0.25}
    for record in [
        Start(resumed_from_step=0, world_size=2, time=105.0).to_record(),
        FirstStep(step=1, time=110.0).to_record(),
        {"step": 6, "loss": 1.0, "time_steps_s": 2.5, **spent},  # 5 steps after its first
        Failure(rank=1, error="ActorDiedError", time=113.0).to_record(),
        Start(resumed_from_step=4, world_size=2, time=118.0).to_record(),
        FirstStep(step=5, time=120.0).to_record(),
    ]:
        follower.handle(record)
    final = {"time_steps_s": 7.0, "time_eval_s": 1.0, "time_checkpoint_s": 0.5}
    split = follower.goodput(began=100.0, ended=130.0, final=final)

    assert split["startup_s"] == 10.0  # to the first group's first step
    assert split["restarts_s"] == 7.0  # the failure at 113 to the new group's first step
    assert split["replayed_s"] == 1.0  # steps 5 and 6, at 0.5 s each
    assert split["steps_s"] == 2.5 + 7.0 - 1.0
    assert split["checkpoint_s"] == 0.75 and split["eval_s"] == 1.5
    assert split["wall_s"] == 30.0
    parts = ("startup_s", "steps_s", "checkpoint_s", "eval_s", "restarts_s", "replayed_s")
    assert split["other_s"] == 30.0 - sum(split[p] for p in parts)
    assert split["goodput"] == split["steps_s"] / 30.0


def test_a_store_outage_the_controller_met_first_is_named_as_the_stores() -> None:
    """Ray Train's controller writes its run state beside the checkpoints, so it can meet
    an object store's outage before any rank does: the one line says the store did not
    answer, as a rank's failed save does; other controller errors keep their own words."""
    follower = RunFollower(display=None, tracker=NullTracker())
    store = StorePath(pafs.LocalFileSystem(), "ckpt/runs/s3run", scheme="s3")
    outage = ray.train.ControllerError(OSError("AWS Error NETWORK_CONNECTION: Could not connect"))
    line = _failure_summary(follower, outage, store)
    assert line.startswith("training failed after 0 worker failure(s)")
    assert "s3://ckpt/runs/s3run: the checkpoint store did not answer (AWS Error" in line

    on_disk = _failure_summary(follower, outage, Path("/runs/s3run"))
    assert on_disk.endswith("last error: AWS Error NETWORK_CONNECTION: Could not connect")
    missing = ray.train.ControllerError(FileNotFoundError("checkpoint_manager_snapshot.json"))
    other = ray.train.ControllerError(RuntimeError("controller died"))
    for error in (missing, other):
        assert "did not answer" not in _failure_summary(follower, error, store)
