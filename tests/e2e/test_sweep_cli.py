"""`trainstack sweep` as a user runs it: 2 strategies × 2 compression settings, ASHA,
MLflow parent and nested trial runs, Ctrl-C and `--resume`, and a best.yaml that trains
what the best trial trained."""

import contextlib
import csv
import json
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import mlflow
import pytest
import yaml

from trainstack.config import load_config
from trainstack.runtime.local import run_processes

from user_shell import BIN, ROOT, run, user_env

pytestmark = pytest.mark.slow

FAST_REPORTS = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.25"}


def write_sweep(tmp_path: Path) -> Path:
    base = {
        "name": "tiny",
        "model": {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32},
        "data": {"vocab_size": 16, "order": 1, "concentration": 0.1, "eval_samples": 64},
        "train": {"steps": 40, "global_batch_size": 16, "micro_batch_size": 8},
        "optim": {"lr": 1.0e-2, "warmup_steps": 2},
        "strategy": {"consistency": "bsp"},  # ps trials deterministic: best.yaml reproduces
        "compression": {"ratio": 0.01, "min_numel": 0},
        "scaling": {"num_workers": 2},
        "log": {"every_steps": 5},
        "checkpoint": {"storage_path": str(tmp_path / "runs")},
        "tracking": {"backend": "mlflow", "uri": f"sqlite:///{tmp_path / 'mlflow.db'}"},
    }
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    sweep = {
        "name": "tiny-sweep",
        "base": "base.yaml",
        "space": {
            "strategy.kind": ["ps", "ddp"],
            "optim.grad_clip": {"values": [0.0], "when": {"strategy.kind": "ps"}},
            "compression.kind": ["none", "topk"],
        },
        "search": {"algorithm": "grid"},
        "scheduler": {"kind": "asha", "grace_fraction": 0.25, "reduction_factor": 2},
        "storage_path": str(tmp_path / "sweeps"),
    }
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(sweep, sort_keys=False))
    return path


@pytest.fixture
def sweep_file(tmp_path: Path) -> Iterator[Path]:
    yield write_sweep(tmp_path)


def interrupt_after_first_trial(sweep_file: Path) -> str:
    """Start the sweep, press Ctrl-C once its first trial has finished; return its output."""
    proc = subprocess.Popen(
        [str(BIN / "trainstack"), "sweep", str(sweep_file)],
        cwd=ROOT,
        env=user_env(**FAST_REPORTS),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    seen: list[str] = []
    deadline = time.time() + 240
    try:
        while not any("[1/4" in x and "done:" in x for x in seen):
            assert time.time() < deadline and proc.poll() is None, "".join(seen)[-3000:]
            with contextlib.suppress(queue.Empty):
                seen.append(lines.get(timeout=1))
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 130, "".join(seen)[-3000:]
    finally:
        proc.kill()
    time.sleep(0.5)
    while not lines.empty():
        seen.append(lines.get())
    return "".join(seen)


def test_interrupted_sweep_resumes_and_ends_with_asha_stops_mlflow_runs_and_best_yaml(
    sweep_file: Path, tmp_path: Path
) -> None:
    first = interrupt_after_first_trial(sweep_file)
    assert "interrupted" in first and "--resume" in first
    sweep_dir = tmp_path / "sweeps" / "tiny-sweep"
    finished_run = next((sweep_dir / "runs").iterdir())
    finished_ckpt = {p.name: p.stat().st_mtime for p in finished_run.glob("checkpoint_*")}
    assert finished_ckpt

    resumed = run(
        [str(BIN / "trainstack"), "sweep", str(sweep_file), "--resume"],
        timeout=400,
        **FAST_REPORTS,
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "[1/4" not in resumed.stdout  # the finished trial did not run again
    assert {p.name: p.stat().st_mtime for p in finished_run.glob("checkpoint_*")} == finished_ckpt

    rows = list(csv.DictReader((sweep_dir / "results.csv").open()))
    statuses = [r["status"] for r in rows]
    assert len(rows) == 4 and "stopped early" in statuses and "completed" in statuses
    assert {(r["strategy.kind"], r["compression.kind"]) for r in rows} == {
        (s, c) for s in ("ps", "ddp") for c in ("none", "topk")
    }
    assert (sweep_dir / "pareto.png").read_bytes()[:4] == b"\x89PNG"

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    parents = [r for r in runs if r.data.tags.get("trainstack.kind") == "sweep"]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert parents[0].data.params["space.compression.kind"] == "['none', 'topk']"
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]
    assert len(children) == 4 == len(runs) - 1  # one per trial: none duplicated by resume
    by_trial = {r.data.tags["trainstack.trial_id"]: r for r in children}
    for row in rows:
        child = by_trial[row["trial"]]
        assert child.data.tags["trainstack.sweep_status"] == row["status"]
        history = client.get_metric_history(child.info.run_id, "eval_loss")
        assert history and all(m.value > 0 for m in history)
        expected = "FINISHED" if row["status"] == "completed" else "KILLED"
        assert child.info.status == expected
    first_trial = finished_run.name.removeprefix("tiny-sweep-")
    assert "trainstack.resumed_count" not in by_trial[first_trial].data.tags

    best = next(r for r in rows if r["trial"] in (sweep_dir / "best.yaml").read_text())
    assert float(best["eval_loss"]) == min(
        float(r["eval_loss"]) for r in rows if r["status"] == "completed"
    )
    reproduced = train_best(sweep_dir / "best.yaml", tmp_path)
    assert abs(reproduced - float(best["eval_loss"])) < 1e-4


def train_best(best_yaml: Path, tmp_path: Path) -> float:
    """Train best.yaml as written; a ddp spec on local processes, a ps one with the CLI."""
    cfg = load_config(str(best_yaml), ["tracking.backend=none"])
    if cfg.strategy.kind == "ddp":
        summary = run_processes(cfg, world_size=2, out_dir=tmp_path / "best")
        return float(summary["eval_loss"])
    out = tmp_path / "best.json"
    proc = run(
        [
            str(BIN / "trainstack"),
            "run",
            str(best_yaml),
            "--set",
            "tracking.backend=none",
            "--summary-json",
            str(out),
        ],
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return float(json.loads(out.read_text())["eval_loss"])
