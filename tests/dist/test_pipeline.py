"""Pipeline parallelism over gloo processes: every schedule, alone and × data parallel,
trains what one process trains (in float64, within `FP64_BOUND` on any CPU); 1F1B holds
fewer activations than GPipe; checkpoints resume exactly and load into other layouts and
strategies."""

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.multiprocessing import ProcessExitedException

from trainstack import checkpoint as ckpt
from trainstack.cli import main as cli_main
from trainstack.config import ConfigError, config_from_dict
from trainstack.models import build_model
from trainstack.runtime.gloo_processes import run_processes
from trainstack.strategies.pipeline_split import check_schedule_runs_here

from bounds import FP64_BOUND, assert_trained, held_out_loss, max_difference

GLOBAL_BATCH = 16


def spec(
    storage: Path,
    *,
    kind: str = "pipeline",
    micro: int = 4,
    workers: int = 1,
    steps: int = 10,
    kill: int | None = None,
    checkpointing: bool = False,
    **strategy: Any,
) -> dict:
    return {
        "name": "pp",
        "model": {
            "kind": "gpt",
            "n_layer": 8,
            "n_head": 2,
            "n_embd": 32,
            "block_size": 16,
            "activation_checkpointing": checkpointing,
        },
        "data": {"vocab_size": 16, "order": 1, "eval_samples": 32},
        "train": {
            "steps": steps,
            "global_batch_size": GLOBAL_BATCH,
            "micro_batch_size": micro,
            "precision": "fp64",
        },
        "optim": {"lr": 1e-2, "warmup_steps": 2, "grad_clip": 1.0, "weight_decay": 0.1},
        "strategy": {"kind": kind, **strategy},
        "scaling": {"num_workers": workers},
        "checkpoint": {"every_steps": 5, "keep": 10, "storage_path": str(storage)},
        "log": {"every_steps": 1},
        "faults": {"kill_at_steps": [kill], "rank": 1} if kill else {},
    }


def pipeline(storage: Path, *, schedule: str, p: int, d: int = 1, m: int = 4, **kw: Any) -> dict:
    return spec(
        storage,
        micro=GLOBAL_BATCH // (d * m),
        workers=p * d,
        schedule=schedule,
        stages=p,
        data_parallel=d,
        microbatches=m,
        **kw,
    )


def train(raw: dict, out: Path, **kw: Any) -> dict[str, Any]:
    cfg = config_from_dict(raw)
    return run_processes(cfg, world_size=cfg.scaling.num_workers, out_dir=out, **kw)


def weights(out: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = torch.load(out / "model.pt", weights_only=True)
    return state


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """Single-process training on the same global batch (in float64 the micro-batches it
    is accumulated in change nothing the bound can see)."""
    tmp = tmp_path_factory.mktemp("reference")
    raw = spec(tmp / "runs", kind="ddp")
    train(raw, tmp / "out")
    assert_trained(weights(tmp / "out"), raw)
    return weights(tmp / "out")


@dataclass
class Run:
    raw: dict[str, Any]
    out: Path
    summary: dict[str, Any]


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Run]:
    """Each pipeline layout's 10-step run, trained once for the module: the schedule
    tests' 1F1B and ZBV runs on 2 stages are also the ones checkpointing, the kill and the
    stage shards start from."""
    root = tmp_path_factory.mktemp("pipelines")
    done: dict[tuple[Any, ...], Run] = {}

    def trained(schedule: str, p: int, d: int = 1, m: int = 4, checkpointing: bool = False) -> Run:
        key = (schedule, p, d, m, checkpointing)
        if key not in done:
            out = root / "-".join(map(str, key))
            raw = pipeline(
                out / "runs", schedule=schedule, p=p, d=d, m=m, checkpointing=checkpointing
            )
            try:  # a schedule this torch cannot run here is refused before it starts
                check_schedule_runs_here(config_from_dict(raw))
            except ConfigError as refused:
                pytest.skip(str(refused))
            done[key] = Run(raw, out, train(raw, out))
        return done[key]

    return trained


LAYOUTS = [
    (schedule, p, d, m)
    for schedule in ("gpipe", "1f1b", "interleaved", "zb_interleaved", "zbv", "dualpipev")
    for p, d, m in ((2, 1, 4), (2, 2, 4))
] + [("1f1b", 4, 1, 4), ("zbv", 4, 1, 8)]
"""Every schedule on 2 stages, alone and x 2 replicas; 4 ranks (middle stages, which hold
neither the embedding nor the head) once with one stage per rank and once as a V."""


@pytest.mark.parametrize(("schedule", "p", "d", "m"), LAYOUTS)
def test_schedule_matches_single_process_training_after_10_steps(
    pipelines: Callable[..., Run],
    reference: dict[str, torch.Tensor],
    schedule: str,
    p: int,
    d: int,
    m: int,
) -> None:
    run = pipelines(schedule, p, d, m)
    summary = run.summary
    diff = max_difference(weights(run.out), reference)
    print(f"{schedule} p={p} d={d} m={m}: max |pipeline - one process| = {diff:.3g}")
    assert diff < FP64_BOUND
    assert summary["world_size"] == p * d
    bubbles = summary["pipeline"]["bubble_fraction_per_rank"]
    assert len(bubbles) == p and all(0 < b < 1 for b in bubbles)
    # The schedule's own order, replayed with equal stages, has the textbook bubble ...
    ideal = summary["pipeline"]["ideal_bubble_fraction"]
    v = 1 if schedule in ("gpipe", "1f1b") else 2
    textbook = (p - 1) / (v * m + p - 1)
    if schedule in ("gpipe", "1f1b", "interleaved"):
        assert ideal == pytest.approx(textbook)
    else:  # ... and the zero-bubble family beats the interleaved one
        assert ideal < textbook / 2


def test_activation_checkpointing_trains_the_same_and_keeps_less(
    pipelines: Callable[..., Run], reference: dict[str, torch.Tensor]
) -> None:
    peaks = {}
    for checkpointing in (False, True):
        run = pipelines("1f1b", 2, checkpointing=checkpointing)
        diff = max_difference(weights(run.out), reference)
        print(f"1f1b p=2 checkpointing={checkpointing}: max |pipeline - one process| = {diff:.3g}")
        assert diff < FP64_BOUND
        peaks[checkpointing] = run.summary["pipeline"]["activation_peak_bytes_per_stage"]
    # Checkpointed, a stage keeps each block's input instead of every intermediate.
    assert all(on < off / 4 for on, off in zip(peaks[True], peaks[False], strict=True))


def test_1f1b_holds_p_minus_s_micro_batches_where_gpipe_holds_all(tmp_path: Path) -> None:
    """Stage s of 1F1B keeps at most p - s micro-batches' activations; GPipe keeps m."""
    p, m = 2, 8
    peaks = {}
    for schedule in ("gpipe", "1f1b"):
        out = tmp_path / schedule
        summary = train(pipeline(out / "runs", schedule=schedule, p=p, m=m, steps=3), out)
        peaks[schedule] = summary["pipeline"]["activation_peak_bytes_per_stage"]
    for s in range(p):
        ratio = peaks["gpipe"][s] / peaks["1f1b"][s]
        assert ratio == pytest.approx(m / (p - s), rel=0.01)


def test_killed_pipeline_resumes_bitwise_identically(
    pipelines: Callable[..., Run], tmp_path: Path
) -> None:
    once = weights(pipelines("1f1b", 2).out)  # 10 steps, uninterrupted
    killed = pipeline(tmp_path / "kill" / "runs", schedule="1f1b", p=2, kill=8)
    with pytest.raises(ProcessExitedException, match="process 1 terminated with exit code 17"):
        train(killed, tmp_path / "kill")  # 17: the fault injector's exit
    summary = train(killed, tmp_path / "kill")
    assert summary["resumed_from_step"] == 5
    resumed = weights(tmp_path / "kill")
    assert all(torch.equal(once[k], resumed[k]) for k in once)


def test_stage_shards_merge_into_weights_any_strategy_loads(
    pipelines: Callable[..., Run], tmp_path: Path
) -> None:
    run = pipelines("zbv", 2)  # read only: the runs below save under tmp_path
    raw, summary = run.raw, run.summary
    final = ckpt.resolve(ckpt.run_dir_for(config_from_dict(raw)))
    stage_files = [name for name in final.manifest["files"] if name.startswith("model/")]
    assert len(stage_files) == 4 and not final.has("model.pt")

    # The merged shards are the whole model: one process evaluates it to the same loss,
    # and the export holds the same tensors.
    merged = final.full_weights()
    cfg = config_from_dict(raw)
    model = build_model(cfg.model, vocab_size=cfg.data.vocab_size, seed=0)
    assert merged.keys() == model.state_dict().keys()
    assert abs(held_out_loss(raw, merged) - summary["eval_loss"]) < 1e-9
    exported = tmp_path / "exported.pt"
    assert cli_main(["export", str(final.path), "--out", str(exported)]) == 0
    assert max_difference(torch.load(exported, weights_only=True), merged) == 0

    # ... and DDP and a 4-rank 1F1B pipeline continue from it.
    for name, later in (
        ("ddp", spec(tmp_path / "ddp-runs", kind="ddp", workers=2, steps=14)),
        ("pp4", pipeline(tmp_path / "pp4-runs", schedule="1f1b", p=4, steps=14)),
    ):
        resumed = train(later, tmp_path / name, resume_from=final.path)
        assert resumed["resumed_from_step"] == 10
        start = json.loads((tmp_path / name / "events.jsonl").read_text().splitlines()[0])
        assert any("optimizer state re-initialised" in note for note in start["notes"])
        assert resumed["final_loss"] < summary["final_loss"] + 0.05
