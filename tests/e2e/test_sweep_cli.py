"""`trainstack sweep` as a user runs it: a grid of a DDP and two parameter-server
trials, ASHA, MLflow parent and nested trial runs, Ctrl-C and `--resume`, and a
best.yaml that trains what the best trial trained; and the random and Optuna searchers,
each running the trials its seed draws from the space (through `run_sweep`, what the
command runs, on one Ray instance for both)."""

import csv
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
import pytest
import ray
import yaml
from ray import tune
from ray.tune.search.optuna import OptunaSearch
from ray.tune.search.variant_generator import generate_variants

from trainstack.config import load_config
from trainstack.runtime.gloo_processes import run_processes
from trainstack.sweep.results import COMPLETED
from trainstack.sweep.runner import run_sweep
from trainstack.sweep.spec import SweepConfig, load_sweep

from user_shell import BIN, ROOT, run, user_env

pytestmark = pytest.mark.slow


def tiny_base(tmp_path: Path, **sections: dict[str, Any]) -> dict[str, Any]:
    """A job spec whose trials take seconds: one worker, a tiny GPT, order-1 data."""
    return {
        "name": "tiny",
        "model": {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32},
        "data": {"vocab_size": 16, "order": 1, "concentration": 0.1, "eval_samples": 64},
        "train": {"steps": 40, "global_batch_size": 16, "micro_batch_size": 8},
        "optim": {"lr": 1.0e-2, "warmup_steps": 2},
        "strategy": {"consistency": "bsp", "num_shards": 1},  # ps trials deterministic
        "compression": {"ratio": 0.01, "min_numel": 0},
        "scaling": {"num_workers": 1},
        "log": {"every_steps": 5},
        "checkpoint": {"storage_path": str(tmp_path / "runs")},
        **sections,
    }


def write_sweep(tmp_path: Path, base: dict[str, Any], **sweep: Any) -> Path:
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    path = tmp_path / "sweep.yaml"
    sweep = {"base": "base.yaml", **sweep, "storage_path": str(tmp_path / "sweeps")}
    path.write_text(yaml.safe_dump(sweep, sort_keys=False))
    return path


@pytest.fixture
def grid_sweep(tmp_path: Path) -> Path:
    """Three trials, one at a time: DDP, then the parameter server sending 1% and 2% of
    its gradient (top-k). Both trail DDP by far (deterministically: every trial seeded,
    the parameter server synchronous), so ASHA stops the second at its first comparison
    and DDP is the best. A parameter-server run reports what its driver sees when it
    polls (every 0.5 s): 30 ms more per step keeps the run going across several polls."""
    tracking = {"backend": "mlflow", "uri": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    on_ps = {"strategy.kind": "ps"}
    return write_sweep(
        tmp_path,
        tiny_base(tmp_path, tracking=tracking, faults={"step_delay_s": 0.03}),
        name="tiny-sweep",
        space={
            "strategy.kind": ["ddp", "ps"],
            "optim.grad_clip": {"values": [0.0], "when": on_ps},
            "compression.kind": {"values": ["topk"], "when": on_ps},
            "compression.ratio": {"values": [0.01, 0.02], "when": on_ps},
        },
        search={"algorithm": "grid", "max_concurrent_trials": 1},
        scheduler={"kind": "asha", "grace_fraction": 0.25, "reduction_factor": 2},
    )


def interrupt_after_asha_stop(sweep_file: Path) -> str:
    """Start the sweep, press Ctrl-C once ASHA has stopped its second trial (the third
    is starting); return its output. The test's timeout is the hang guard."""
    proc = subprocess.Popen(
        [str(BIN / "trainstack"), "sweep", str(sweep_file)],
        cwd=ROOT,
        env=user_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    seen: list[str] = []
    stopped = threading.Event()

    def read(stdout: Any) -> None:
        for line in stdout:
            seen.append(line)
            if "[2/3" in line and "stopped early by ASHA" in line:
                stopped.set()
        stopped.set()  # the sweep's output ended: no point waiting

    reader = threading.Thread(target=read, args=(proc.stdout,))
    reader.start()
    try:
        stopped.wait()
        assert proc.poll() is None, "".join(seen)[-3000:]
        proc.send_signal(signal.SIGINT)
        assert proc.wait() == 130, "".join(seen)[-3000:]
    finally:
        proc.kill()
        reader.join()
        proc.stdout.close()
    return "".join(seen)


@pytest.mark.timeout(600)
def test_interrupted_sweep_resumes_and_ends_with_asha_stops_mlflow_runs_and_best_yaml(
    grid_sweep: Path, tmp_path: Path
) -> None:
    first = interrupt_after_asha_stop(grid_sweep)
    assert "[1/3" in first and "done:" in first
    assert "interrupted" in first and "--resume" in first
    sweep_dir = tmp_path / "sweeps" / "tiny-sweep"
    ended = [r for r in (sweep_dir / "runs").iterdir() if not r.name.endswith("_00002")]
    assert len(ended) == 2  # (the third may have started too)
    checkpoints = {p: p.stat().st_mtime for r in ended for p in r.glob("checkpoint_*")}
    assert checkpoints

    resumed = run([str(BIN / "trainstack"), "sweep", str(grid_sweep), "--resume"])
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    # The two trials that ended did not run again: their checkpoints are untouched.
    assert "[3/3" in resumed.stdout
    assert "[1/3" not in resumed.stdout and "[2/3" not in resumed.stdout
    assert {p: p.stat().st_mtime for r in ended for p in r.glob("checkpoint_*")} == checkpoints

    rows = list(csv.DictReader((sweep_dir / "results.csv").open()))
    assert [(r["strategy.kind"], r["compression.ratio"], r["status"]) for r in rows] == [
        ("ddp", "", "completed"),
        ("ps", "0.01", "stopped early"),  # at its first report past a rung
        ("ps", "0.02", "completed"),  # alone after the resume: nothing to compare with
    ]
    assert int(rows[1]["step"]) < 40
    assert (sweep_dir / "pareto.png").read_bytes()[:4] == b"\x89PNG"

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    parents = [r for r in runs if r.data.tags.get("trainstack.kind") == "sweep"]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    space = parents[0].data.params["space.compression.ratio"]
    assert space == "[0.01, 0.02] when strategy.kind in ['ps']"
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]
    assert len(children) == 3 == len(runs) - 1  # one per trial: none duplicated by resume
    by_trial = {r.data.tags["trainstack.trial_id"]: r for r in children}
    for row in rows:
        child = by_trial[row["trial"]]
        assert child.data.tags["trainstack.sweep_status"] == row["status"]
        history = client.get_metric_history(child.info.run_id, "eval_loss")
        assert history and all(m.value > 0 for m in history)
        expected = "FINISHED" if row["status"] == "completed" else "KILLED"
        assert child.info.status == expected
    assert "trainstack.resumed_count" not in by_trial[rows[0]["trial"]].data.tags

    best = rows[0]
    assert float(best["eval_loss"]) < float(rows[2]["eval_loss"])
    assert best["trial"] in (sweep_dir / "best.yaml").read_text()
    cfg = load_config(str(sweep_dir / "best.yaml"), ["tracking.backend=none"])
    reproduced = run_processes(cfg, world_size=1, out_dir=tmp_path / "best")
    # The same run, bit for bit (results.csv rounds; the trial's MLflow run does not).
    assert reproduced["eval_loss"] == by_trial[best["trial"]].data.metrics["final/eval_loss"]


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    """One Ray instance for the searcher tests' sweeps (2 CPUs: two 1-worker trials at once)."""
    if ray.is_initialized():  # another module's instance: these sweeps need their own
        ray.shutdown()
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
    )
    yield
    ray.shutdown()


SPACE = {
    "optim.lr": "loguniform(0.001, 0.03)",
    "train.micro_batch_size": [4, 8],  # drawn per trial; a grid would run both
}
SEED = 7


def searcher_sweep(tmp_path: Path, algorithm: str) -> SweepConfig:
    """Two quick parameter-server trials drawn from SPACE by `algorithm`, at once."""
    base = tiny_base(
        tmp_path,
        train={"steps": 8, "global_batch_size": 16, "micro_batch_size": 8},
        strategy={"kind": "ps", "consistency": "bsp", "num_shards": 1},
        optim={"warmup_steps": 1, "grad_clip": 0.0},
        log={"every_steps": 4},
    )
    return load_sweep(
        write_sweep(
            tmp_path,
            base,
            name=f"{algorithm}-sweep",
            space=SPACE,
            search={"algorithm": algorithm, "num_samples": 2, "seed": SEED},
            scheduler={"kind": "fifo"},
        )
    )


def trials_run(sweep: SweepConfig) -> list[tuple[float, int]]:
    """The values each trial ran with, from results.csv (after checking that every trial
    completed and best.yaml names the best), sorted."""
    rows = list(csv.DictReader((sweep.sweep_dir / "results.csv").open()))
    assert [r["status"] for r in rows] == [COMPLETED, COMPLETED]
    best = min(rows, key=lambda r: float(r["eval_loss"]))
    assert f"Best trial {best['trial']} " in (sweep.sweep_dir / "best.yaml").read_text()
    return sorted((float(r["optim.lr"]), int(r["train.micro_batch_size"])) for r in rows)


@pytest.mark.timeout(300)
def test_random_search_runs_the_trials_its_seed_draws_from_the_space(
    local_ray: None, tmp_path: Path
) -> None:
    sweep = searcher_sweep(tmp_path, "random")
    run_sweep(sweep)
    # Tune's variant generator seeded with search.seed draws every key of the space per
    # trial (trainstack's layout of the space: distributions, then lists).
    lr, mbs = "optim.lr", "train.micro_batch_size"
    domains = {lr: tune.loguniform(0.001, 0.03), mbs: tune.choice([4, 8])}
    rng = np.random.default_rng(SEED)
    draws = [next(generate_variants(domains, random_state=rng))[1] for _ in range(2)]
    assert trials_run(sweep) == sorted((d[lr], d[mbs]) for d in draws)


@pytest.mark.timeout(300)
def test_optuna_search_runs_the_trials_its_seeded_study_suggests(
    local_ray: None, tmp_path: Path
) -> None:
    sweep = searcher_sweep(tmp_path, "optuna")
    run_sweep(sweep)

    # An Optuna study asking for SPACE's keys with the same seed: its sampler suggests
    # the first trials whatever their results (TPE starts from independent draws).
    def space(trial: Any) -> None:
        trial.suggest_float("optim.lr", 0.001, 0.03, log=True)
        trial.suggest_categorical("mbs", [4, 8])

    study = OptunaSearch(space=space, metric="eval_loss", mode="min", seed=SEED)
    suggested = [study.suggest(f"t{i}") for i in range(2)]
    assert trials_run(sweep) == sorted((s["optim.lr"], s["mbs"]) for s in suggested)
