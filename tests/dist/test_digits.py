"""The digits example end to end: `examples/prepare_digits.py` writes scikit-learn's
8 x 8 digits as .npz files, and `examples/specs/digits_cnn.yaml` trains the example
CNN on them (`data.kind: arrays`) under DDP on 2 gloo processes, as written: run
from a folder holding `data/digits`, as from examples/ after the prepare step.
"""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

from trainstack.config import load_config
from trainstack.runtime.gloo_processes import run_processes

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

pytest.importorskip(
    "sklearn", reason="scikit-learn ships the digits data: pip install scikit-learn"
)


@pytest.mark.slow
def test_digits_cnn_under_ddp_reaches_95_percent_held_out_accuracy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # the spec's relative paths: data/digits, runs/
    prepare = runpy.run_path(str(EXAMPLES / "prepare_digits.py"))
    prepare["write_digits"](Path("data/digits"))
    cfg = load_config(str(EXAMPLES / "specs" / "digits_cnn.yaml"))
    summary = run_processes(cfg, world_size=2, out_dir=tmp_path / "out")
    accuracy, loss, train_s = summary["eval_accuracy"], summary["eval_loss"], summary["train_s"]
    print(f"digits: eval_accuracy {accuracy:.4f}, eval_loss {loss:.4f}, training {train_s:.1f} s")
    assert summary["world_size"] == 2 and summary["task"] == "classify"
    assert accuracy >= 0.95
