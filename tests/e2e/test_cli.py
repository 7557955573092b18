"""`trainstack run` and `jobs/train.py` as a user runs them."""

from pathlib import Path

import pytest

from user_shell import BIN, ROOT, run


@pytest.mark.parametrize(
    "command",
    [
        [str(BIN / "trainstack"), "run"],
        [str(BIN / "python"), "jobs/train.py", "--config"],
    ],
)
def test_bad_spec_exits_2_with_one_line_and_no_traceback(
    command: list[str], bad_spec: Path
) -> None:
    proc = run([*command, str(bad_spec)])
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("trainstack: error: unknown key 'optim.lrr'")
    assert "did you mean 'optim.lr'" in lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout


def test_bad_override_exits_2(tmp_path: Path) -> None:
    proc = run(
        [
            str(BIN / "trainstack"),
            "run",
            "jobs/configs/demo.yaml",
            "--set",
            "train.global_batch_size=30",
        ],
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("trainstack: error: train.global_batch_size=30")
    assert len(proc.stderr.strip().splitlines()) == 1


def test_missing_spec_file_exits_2(tmp_path: Path) -> None:
    proc = run([str(BIN / "trainstack"), "run", str(tmp_path / "nope.yaml")])
    assert proc.returncode == 2
    assert "nope.yaml" in proc.stderr and "Traceback" not in proc.stderr


def test_corrupt_checkpoints_stop_the_run_with_one_line(tmp_path: Path) -> None:
    broken = tmp_path / "runs" / "demo" / "checkpoint_00000010"
    broken.mkdir(parents=True)
    (broken / "manifest.json").write_text("{not json")
    proc = run(
        [
            str(BIN / "trainstack"),
            "run",
            "jobs/configs/demo.yaml",
            "--set",
            f"checkpoint.storage_path={tmp_path / 'runs'}",
        ],
    )
    assert proc.returncode == 2
    errors = proc.stderr.strip().splitlines()
    assert len(errors) == 1 and "checkpoint.on_corrupt=restart" in errors[0]
    assert "skipping checkpoint checkpoint_00000010" in proc.stdout
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["model.target=no_such_pkg.models:build"], "no module named 'no_such_pkg.models'"),
        (["model.target=user_models.cnn:nope"], "'user_models.cnn' has no attribute 'nope'"),
        (["model.args={width: -3}"], "raised"),
        (["task.loss=user_models.losses:nope"], "task.loss="),
        (
            ["strategy.kind=pipeline", "model.target=user_models.cnn:Flat", "model.args={}"],
            "pipeline",
        ),
    ],
    ids=["no-module", "no-attribute", "factory-raised", "no-loss", "pipeline-without-layers"],
)
def test_bad_model_target_exits_2_with_one_line_before_anything_starts(
    tmp_path: Path, overrides: list[str], expected: str
) -> None:
    storage = tmp_path / "runs"
    sets = [arg for o in [*overrides, f"checkpoint.storage_path={storage}"] for arg in ("--set", o)]
    proc = run(
        [str(BIN / "trainstack"), "run", "examples/specs/cnn_classify.yaml", *sets],
        PYTHONPATH=str(ROOT / "examples"),
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("trainstack: error: "), proc.stderr
    assert expected in lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not storage.exists(), "nothing may start (or be written) for a bad model"
