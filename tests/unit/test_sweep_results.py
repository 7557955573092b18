"""A sweep's results: Pareto front, best trial under each objective, table, CSV, plot."""

import csv
import math
from pathlib import Path

from trainstack.sweep.results import (
    COMPLETED,
    FAILED,
    STOPPED,
    TrialRow,
    best_trial,
    format_table,
    label_for,
    pareto_front,
    plot_pareto,
    write_csv,
)
from trainstack.sweep.spec import ObjectiveConfig


def row(
    trial_id: str,
    loss: float,
    tps: float,
    status: str = COMPLETED,
    bytes_per_step: float = math.nan,
) -> TrialRow:
    overrides = {"strategy.kind": trial_id.split("-")[0], "optim.lr": 0.003}
    return TrialRow(
        trial_id=trial_id,
        label=label_for(overrides),
        overrides=overrides,
        status=status,
        step=100,
        tokens=6400,
        eval_loss=loss,
        tokens_per_s=tps,
        elapsed_s=12.5,
        bytes_per_step=bytes_per_step,
    )


ROWS = [
    row("ddp-a", 2.30, 90_000),  # front: fastest
    row("zero-b", 2.28, 60_000),  # front: lowest loss
    row("ps-c", 2.35, 70_000),  # beaten by ddp-a on both
    row("ddp-d", 2.10, 95_000, STOPPED),  # stopped early: its loss is not final
    row("ps-e", math.nan, math.nan, FAILED),
]


def test_label_is_short_and_names_non_kind_keys() -> None:
    assert label_for({"strategy.kind": "zero", "strategy.stage": 2, "optim.lr": 0.00312}) == (
        "zero, stage=2, lr=0.00312"
    )


def test_pareto_front_keeps_completed_trials_nothing_beats_on_both_axes() -> None:
    assert [r.trial_id for r in pareto_front(ROWS)] == ["ddp-a", "zero-b"]


def test_best_trial_by_loss_and_by_throughput_within_a_loss_bound() -> None:
    assert best_trial(ROWS, ObjectiveConfig(metric="eval_loss")).trial_id == "zero-b"
    fastest = ObjectiveConfig(metric="tokens_per_s")
    assert best_trial(ROWS, fastest).trial_id == "ddp-a"
    bounded = ObjectiveConfig(metric="tokens_per_s", loss_bound=2.29)
    assert best_trial(ROWS, bounded).trial_id == "zero-b"
    assert best_trial(ROWS, ObjectiveConfig(metric="tokens_per_s", loss_bound=2.0)) is None


def test_table_marks_the_best_and_csv_round_trips(tmp_path: Path) -> None:
    best = best_trial(ROWS, ObjectiveConfig())
    lines = format_table(ROWS, best=best).splitlines()
    assert lines[0].split() == [
        "trial",
        "setting",
        "status",
        "step",
        "tokens",
        "eval_loss",
        "tokens_per_s",
        "train_s",
        "bytes/step",
    ]
    assert lines[2].startswith("* zero-b") and "2.2800" in lines[2] and "60000" in lines[2]
    write_csv(ROWS, tmp_path / "results.csv")
    read = list(csv.DictReader((tmp_path / "results.csv").open()))
    assert [r["status"] for r in read] == [r.status for r in ROWS]
    assert read[1]["eval_loss"] == "2.2800" and read[1]["strategy.kind"] == "zero"
    assert read[4]["eval_loss"] == ""  # a failed trial has no figures


def test_pareto_plot_is_a_png(tmp_path: Path) -> None:
    path = tmp_path / "pareto.png"
    plot_pareto(ROWS, path, title="sweep t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


COMPRESSED = [
    row("none-a", 2.30, 90_000, bytes_per_step=423_424),  # front: lowest loss
    row("topk-b", 2.36, 80_000, bytes_per_step=14_000),  # front: fewest bytes
    row("powersgd-c", 2.35, 85_000, bytes_per_step=46_080),  # front: between them
    row("qsgd-d", 2.40, 70_000, bytes_per_step=57_912),  # beaten by powersgd-c on both
    row("topk-e", 2.10, 95_000, STOPPED, bytes_per_step=1_000),  # stopped early
    row("zero-f", 2.20, 60_000),  # no bytes measured: not on this front
]


def test_bytes_front_keeps_the_fewest_bytes_for_each_loss() -> None:
    front = pareto_front(COMPRESSED, "bytes_per_step")
    assert [r.trial_id for r in front] == ["topk-b", "powersgd-c", "none-a"]
    # against tokens/s the same trials give another front (zero-f has no bytes only)
    assert [r.trial_id for r in pareto_front(COMPRESSED)] == ["none-a", "zero-f"]


def test_bytes_column_and_plot(tmp_path: Path) -> None:
    lines = format_table(COMPRESSED, best=None).splitlines()
    assert lines[0].split()[-1] == "bytes/step"
    assert lines[1].rstrip().endswith("423,424") and lines[6].rstrip().endswith("12.5")
    path = tmp_path / "pareto_bytes.png"
    plot_pareto(COMPRESSED, path, title="sweep t", against="bytes_per_step")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_bytes_front_ties_keep_both_equals_and_drop_the_worse_at_equal_bytes() -> None:
    rows = [
        row("topk-a", 2.36, 80_000, bytes_per_step=14_000),
        row("topk-b", 2.36, 70_000, bytes_per_step=14_000),  # equal on both: kept too
        row("topk-c", 2.40, 90_000, bytes_per_step=14_000),  # same bytes, higher loss
        row("none-d", 2.36, 95_000, bytes_per_step=423_424),  # same loss, more bytes
        row("sign-e", 2.30, 85_000, bytes_per_step=math.nan),  # bytes not measured
    ]
    front = pareto_front(rows, "bytes_per_step")
    assert sorted(r.trial_id for r in front) == ["topk-a", "topk-b"]
