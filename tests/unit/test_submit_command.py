"""`trainstack submit`'s parts that need no cluster: the job's command, its name, and a
bad spec refused before anything is uploaded (the e2e test submits to a real cluster)."""

import re
import shlex
from pathlib import Path

import pytest

from trainstack.cli import main
from trainstack.cli.submit import entrypoint, job_metadata, submission_id
from trainstack.config import load_config

ROOT = Path(__file__).resolve().parents[2]
DEMO = str(ROOT / "jobs/configs/demo.yaml")


def test_the_job_runs_jobs_train_py_on_the_spec_with_its_overrides() -> None:
    command = entrypoint(
        "jobs/configs/demo.yaml", ["train.steps=5", "name=a b"], summary_json="/tmp/s.json"
    )
    assert shlex.split(command) == [
        *("python", "jobs/train.py", "--config", "jobs/configs/demo.yaml"),
        *("--set", "train.steps=5", "--set", "name=a b", "--progress", "lines"),
        *("--summary-json", "/tmp/s.json"),
    ]


def test_the_job_is_named_after_the_spec() -> None:
    cfg = load_config(DEMO, ["strategy.kind=zero"])
    name = submission_id(cfg)
    assert re.fullmatch(r"trainstack-demo-zero-[0-9a-f]{8}", name)
    assert submission_id(cfg) != name  # each submission its own
    assert job_metadata(cfg, spec="jobs/configs/demo.yaml")["trainstack.strategy"] == "zero"


def test_a_bad_spec_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad_spec = tmp_path / "bad.yaml"
    bad_spec.write_text("name: x\noptim:\n  lrr: 0.1\n")
    assert main(["submit", str(bad_spec), "--address", "http://127.0.0.1:1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("trainstack: error: ")
