"""`trainstack report` against a real SQLite MLflow store, filled by trainstack.observe.tracking
itself (start_tracking / log_metrics / finish), so the format is the one jobs write.
One store and the reports of its runs are shared by the module (MLflow's migrations and
matplotlib's import take seconds)."""

from __future__ import annotations

import argparse
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from trainstack.cli.report import add_report_parser
from trainstack.config import ConfigError, JobConfig, StrategyConfig, TrackingConfig
from trainstack.observe.tracking import start_tracking
from trainstack.report.document import write_report
from trainstack.report.runs import Series

FLOOR = 2.0
FINAL_EVAL = 2.6  # 30% above FLOOR
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def record(step: int, *, restarts: int) -> dict[str, Any]:
    """A log record as the training loop sends it, with the driver's restart count."""
    return {
        "step": step,
        "steps": 100,
        "loss": 3.4 - 0.008 * step,
        "lr": 3e-3,
        "grad_norm": 0.8,
        "tokens_per_s": 60_000.0 + 100 * step,
        "samples_per_s": 900.0,
        "step_time_s": 0.07,
        "mfu": None,  # CPU: no peak FLOPs
        "peak_mem_bytes": 500 * 2**20 + step * 2**16,
        "elapsed_s": step * 0.07,
        "bytes_on_wire": 423_424,
        "compression_ratio": 1.0,
        "restarts": restarts,
        **({"eval_loss": 3.0 - 0.004 * step} if step in (40, 80) else {}),
    }


DDP_SUMMARY = {
    "final_loss": FINAL_EVAL,
    "final_train_loss": 2.62,
    "eval_loss": FINAL_EVAL,
    "entropy_floor": FLOOR,
    "steps": 100,
    "tokens_per_s": 65_432.0,
    "mfu": None,
    "world_size": 2,
    "strategy": "ddp",
    "device": "cpu",
    "params": 105_856,
    "peak_mem_bytes": 520 * 2**20,
    "model_state_bytes": {"params": 423_424, "grads": 423_424},
    "train_s": 7.5,
    "wall_s": 42.0,
    "restarts": 1,
    "recovery": [{"resumed_from_step": 50, "failed_after_step": 64, "steps_lost": 14}],
    "goodput": 0.25,
    "goodput_wall_s": 42.0,
    "goodput_startup_s": 20.0,
    "goodput_steps_s": 10.5,
    "goodput_checkpoint_s": 1.5,
    "goodput_eval_s": 0.5,
    "goodput_restarts_s": 6.0,
    "goodput_replayed_s": 2.5,
    "goodput_other_s": 1.0,
}

PS_SUMMARY = {
    "strategy": "ps",
    "world_size": 2,
    "device": "cpu",
    "steps": 60,
    "final_loss": 3.1,
    "eval_loss": 3.1,
    "entropy_floor": FLOOR,
    "tokens_per_s": 45_000.0,
    "mfu": None,
    "peak_mem_bytes": 456 * 2**20,
    "train_s": 20.0,
    "params": 105_856,
    "restarts": 0,
    "ps": {
        "consistency": "async",
        "num_shards": 2,
        "updates_per_s": 22.5,
        "pushes": 240,
        "rejected": 0,
        "staleness_mean": 0.99,
        "staleness_p50": 1.0,
        "staleness_p99": 2.0,
        "staleness_max": 6,
        "clock_gap_max": 0,
        "waits": 0,
        "wait_s": 0.0,
        "worker_clocks": [60, 60],
        "worker_steps_per_s": [12.1, 12.2],
        "worker_seconds": [
            {"compute": 16.2, "push": 7.7, "pull": 0.02, "wait": 0.0, "slow": 0.0},
            {"compute": 16.0, "push": 7.6, "pull": 0.02, "wait": 0.0, "slow": 0.0},
        ],
        "worker_restarts": [0, 0],
        "shard_failures": [],
        "bytes_pushed": 50 * 2**20,
        "compression_ratio": 1.0,
    },
}


def tracked_run(store: str, run_dir: Path, *, strategy: str = "ddp") -> Any:
    cfg = JobConfig(
        name=run_dir.name,
        strategy=StrategyConfig(kind=strategy),
        tracking=TrackingConfig(backend="mlflow", uri=store, experiment="report-tests"),
    )
    tracker = start_tracking(cfg, run_dir=run_dir)
    assert tracker.error is None, tracker.error
    return tracker


def log(tracker: Any, steps: range, *, restarts: int) -> None:
    for step in steps:
        tracker.log_metrics(record(step, restarts=restarts), step=step)
        time.sleep(0.002)  # distinct timestamps: MLflow orders a history by them


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    return f"sqlite:///{tmp_path_factory.mktemp('store') / 'mlflow.db'}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="module")
def ddp_run(store: str, runs: Path) -> str:
    """Steps 10..60, a worker dies after step 64, the group resumes from step 50."""
    tracker = tracked_run(store, runs / "report-ddp")
    log(tracker, range(10, 70, 10), restarts=0)
    log(tracker, range(50, 110, 10), restarts=1)
    tracker.finish(DDP_SUMMARY, failed=False)
    return str(tracker.run_id)


@pytest.fixture(scope="module")
def ddp_report(ddp_run: str, store: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("report") / "ddp"
    return write_report(ddp_run, out_dir=out, tracking_uri=store)


@pytest.fixture(scope="module")
def ps_report(store: str, runs: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    tracker = tracked_run(store, runs / "report-ps", strategy="ps")
    for step in (1, 20, 40, 60):  # the driver's progress records: no memory, bytes or restarts
        tracker.log_metrics(
            {"step": step, "loss": 3.4 - step / 200, "tokens_per_s": 45e3, "mfu": None},
            step=step,
        )
    tracker.finish(PS_SUMMARY, failed=False)
    out = tmp_path_factory.mktemp("report") / "ps"
    return write_report(str(tracker.run_id), out_dir=out, tracking_uri=store)


@pytest.fixture
def cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    yield tmp_path


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path.name} is not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_ddp_report_draws_loss_throughput_memory_comm_and_goodput_at_1200x700(
    ddp_report: Path,
) -> None:
    folder = ddp_report.parent
    for name in ("loss.png", "throughput.png", "memory.png", "comm.png", "goodput.png"):
        assert png_size(folder / name) == (1200, 700), name
        assert (folder / name).stat().st_size > 20_000, f"{name} looks empty"
    assert not (folder / "staleness.png").exists()
    text = ddp_report.read_text()
    for name in ("loss.png", "throughput.png", "memory.png", "comm.png", "goodput.png"):
        assert f"]({name})" in text  # embedded with a relative link


def test_report_states_final_loss_and_percent_above_the_entropy_floor(ddp_report: Path) -> None:
    text = ddp_report.read_text()
    assert "| final loss | 2.6000 (held-out) |" in text
    assert "2.6000 vs 2.0000: +30.0% above the floor" in text
    assert "| tokens/s | 65,432 (steady state) |" in text
    assert "| MFU | n/a (no peak FLOPs known for CPU) |" in text
    assert "| peak memory | 520 MiB (rank 0, RSS) |" in text
    assert "| wall time | 42.0 s (training 7.5 s) |" in text
    assert (
        "| goodput | 25.0% of 42.0 s in training steps (start-up 20.0, checkpoints 1.5, "
        "eval 0.5, restarts 6.0, replayed 2.5, other 1.0) |" in text
    )


def test_report_lists_the_restart_where_the_restarts_metric_rises(ddp_report: Path) -> None:
    text = ddp_report.read_text()
    assert "| restarts | 1 (steps lost: 14) |" in text
    assert "- restart 1: logging resumed at step 50," in text
    assert "failed after step 64 and resumed from the checkpoint at step 50 (14 steps lost)" in text


def test_report_names_the_run_and_embeds_its_spec(ddp_report: Path, ddp_run: str) -> None:
    text = ddp_report.read_text()
    assert text.startswith("# Run report: report-ddp\n")
    assert f"`{ddp_run}`" in text
    assert "| status | FINISHED |" in text
    assert "| device | 2 × CPU worker(s) |" in text
    spec = text.split("```yaml\n", 1)[1].split("```", 1)[0]
    assert "name: report-ddp" in spec and "backend: mlflow" in spec


def test_ps_report_draws_staleness_and_says_why_memory_and_comm_are_missing(
    ps_report: Path,
) -> None:
    folder = ps_report.parent
    assert png_size(folder / "staleness.png") == (1200, 700)
    assert not (folder / "memory.png").exists() and not (folder / "comm.png").exists()
    text = ps_report.read_text()
    assert "](staleness.png)" in text
    assert "Not drawn: the run logged no per-step peak memory (the summary's peak: 456 MiB)" in text
    assert "Not drawn: a parameter server logs only its total (50.0 MiB pushed)" in text
    assert "| ps staleness | mean 0.99, p50 1, p99 2, max 6 updates |" in text
    assert "| ps updates/s (per shard) | 22.5 |" in text


def test_failed_run_without_summary_reports_its_last_logged_loss(
    store: str, runs: Path, tmp_path: Path
) -> None:
    tracker = tracked_run(store, runs / "report-failed")
    log(tracker, range(10, 40, 10), restarts=0)
    tracker.finish({}, failed=True)
    text = write_report(str(tracker.run_id), out_dir=tmp_path, tracking_uri=store).read_text()
    assert "| status | FAILED |" in text
    assert f"| final loss | {3.4 - 0.008 * 30:.4f} (last logged training loss) |" in text
    assert png_size(tmp_path / "loss.png") == (1200, 700)


def test_run_directory_finds_its_run_and_store_through_tracking_json(
    ddp_run: str, runs: Path, tmp_path: Path, cwd: Path
) -> None:
    report = write_report(str(runs / "report-ddp"), out_dir=tmp_path / "out", tracking_uri=None)
    assert f"`{ddp_run}`" in report.read_text()


def test_unknown_run_id_is_a_one_line_config_error(store: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no MLflow run '0123abcd' in sqlite:///") as err:
        write_report("0123abcd", out_dir=tmp_path, tracking_uri=store)
    assert "\n" not in str(err.value) and "run directory with tracking.json" in str(err.value)


def test_directory_without_tracking_json_is_a_one_line_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"has no tracking\.json: RUN must be") as err:
        write_report(str(tmp_path), out_dir=tmp_path / "out", tracking_uri=None)
    assert "\n" not in str(err.value)


def test_missing_sqlite_store_is_an_error_and_is_not_created(tmp_path: Path) -> None:
    db = tmp_path / "nowhere.db"
    with pytest.raises(ConfigError, match=r"tracking store sqlite:///.*nowhere\.db does not exist"):
        write_report("0123abcd", out_dir=tmp_path / "out", tracking_uri=f"sqlite:///{db}")
    assert not db.exists()


def test_unreachable_tracking_server_is_a_one_line_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    with pytest.raises(
        ConfigError, match=r"^cannot read tracking store http://127\.0\.0\.1:9: "
    ) as err:
        write_report("0123abcd", out_dir=tmp_path / "out", tracking_uri="http://127.0.0.1:9")
    assert "\n" not in str(err.value)


def run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="trainstack")
    add_report_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    code: int = args.handler(args)
    return code


def test_cli_bad_run_id_exits_2_with_one_error_line(
    ddp_run: str, store: str, cwd: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # ddp_run makes the store exist, so the error is about the id, whichever xdist
    # worker runs this test first.
    assert run_cli("report", "0123abcd", "--tracking-uri", store) == 2
    err = capsys.readouterr().err
    assert err.startswith("trainstack: error: no MLflow run '0123abcd'")
    assert err.count("\n") == 1
    assert not (cwd / "reports").exists()


def test_cli_writes_to_reports_run_name_by_default(
    ddp_run: str, store: str, cwd: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_cli("report", ddp_run, "--tracking-uri", store) == 0
    assert (cwd / "reports" / "report-ddp" / "report.md").is_file()
    assert "wrote reports/report-ddp/report.md" in capsys.readouterr().out


def test_series_pieces_break_where_steps_are_replayed() -> None:
    series = Series(steps=[10, 20, 30, 20, 30, 40], values=[0.0] * 6, times_s=[0.0] * 6)
    assert series.pieces() == [range(0, 3), range(3, 6)]


def test_an_moe_run_gets_a_plot_of_each_experts_share_and_the_balance(
    store: str, runs: Path, tmp_path: Path
) -> None:
    tracker = tracked_run(store, runs / "report-moe")
    for step in range(10, 110, 10):  # expert 0's share falls from 0.55 toward an even 0.25
        shares = [0.25 + 0.3 * (100 - step) / 90, *[0.25 - 0.1 * (100 - step) / 90] * 3]
        routing = {f"moe_load_e{i}": share for i, share in enumerate(shares)}
        routing.update(moe_load_cv=0.4 * (100 - step) / 90, moe_drop_rate=0.01)
        tracker.log_metrics({**record(step, restarts=0), **routing}, step=step)
        time.sleep(0.002)
    tracker.finish({**DDP_SUMMARY, "moe_load_cv": 0.123, "moe_drop_rate": 0.0042}, failed=False)
    report = write_report(str(tracker.run_id), out_dir=tmp_path, tracking_uri=store)
    assert png_size(tmp_path / "experts.png") == (1200, 700)
    assert (tmp_path / "experts.png").stat().st_size > 20_000
    text = report.read_text()
    assert "](experts.png)" in text
    assert "Over the run: load CV 0.123, 0.42% of assignments dropped." in text


def test_a_dense_run_has_no_experts_plot(ddp_report: Path) -> None:
    assert not (ddp_report.parent / "experts.png").exists()
    assert "experts.png" not in ddp_report.read_text()


def test_a_dpo_run_gets_a_plot_of_its_held_out_rewards_and_preference_accuracy(
    store: str, runs: Path, tmp_path: Path
) -> None:
    tracker = tracked_run(store, runs / "report-dpo")
    for step in range(10, 100, 10):  # the margin opens and the accuracy rises from a coin's
        rewards = {"eval_reward_chosen": 0.01 * step / 10, "eval_reward_rejected": -0.02 * step}
        rewards["eval_reward_margin"] = (
            rewards["eval_reward_chosen"] - rewards["eval_reward_rejected"]
        )
        metrics = {**record(step, restarts=0), **rewards, "eval_accuracy": 0.5 + 0.4 * step / 100}
        tracker.log_metrics(metrics, step=step)
        time.sleep(0.002)
    final = {"eval_accuracy": 0.9, "eval_reward_chosen": 0.1, "eval_reward_rejected": -2.0}
    tracker.finish({**DDP_SUMMARY, **final, "eval_reward_margin": 2.1}, failed=False)
    report = write_report(str(tracker.run_id), out_dir=tmp_path, tracking_uri=store)
    assert png_size(tmp_path / "preferences.png") == (1200, 700)
    assert (tmp_path / "preferences.png").stat().st_size > 20_000
    text = report.read_text()
    assert "](preferences.png)" in text
    assert "At the end: 90.0% of pairs." in text
    assert "| preferences | 90.0% of held-out pairs prefer the chosen answer (rewards: " in text


def test_a_run_without_preferences_has_no_preferences_plot(ddp_report: Path) -> None:
    assert not (ddp_report.parent / "preferences.png").exists()
    assert "preferences" not in ddp_report.read_text()
