"""FSDP2 and tensor parallelism on one device mesh: every layout trains what one process
trains, resumes bitwise after a killed worker, and hands its sharded checkpoint to
another layout (optimizer state included) that continues as if nothing had changed."""

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from trainstack import checkpoint as ckpt
from trainstack.config import config_from_dict
from trainstack.runtime.capacity import model_state
from trainstack.runtime.local import run_processes

STEPS = 10
LAYOUTS = {  # name: (workers, strategy)
    "ddp1": (1, {"kind": "ddp"}),
    "fsdp2": (2, {"kind": "fsdp"}),
    "fsdp4": (4, {"kind": "fsdp"}),
    "tp2": (2, {"kind": "fsdp", "tensor_parallel": 2}),
    "tp2xdp2": (4, {"kind": "fsdp", "tensor_parallel": 2}),
    "hsdp2x2": (4, {"kind": "fsdp", "data_parallel_replicate": 2}),
}


def spec(layout: str, storage: Path, **extra: Any) -> dict[str, Any]:
    workers, strategy = LAYOUTS[layout]
    replicas = workers // strategy.get("tensor_parallel", 1)
    return {
        "name": f"mesh-{layout}",
        "model": {"kind": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16},
        "data": {"vocab_size": 16, "order": 1, "eval_samples": 32},
        "train": {"steps": STEPS, "global_batch_size": 16, "micro_batch_size": 8 // replicas},
        "optim": {"lr": 1e-2, "warmup_steps": 2, "grad_clip": 1.0, "weight_decay": 0.1},
        "strategy": strategy,
        "scaling": {"num_workers": workers},
        "log": {"every_steps": 5},
        "checkpoint": {"storage_path": str(storage), "every_steps": 1, "keep": STEPS},
        **extra,
    }


def train(
    out: Path, layout: str, *, resume_from: Path | None = None, **extra: Any
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    cfg = config_from_dict(spec(layout, out / "runs", **extra))
    summary = run_processes(
        cfg, world_size=cfg.scaling.num_workers, out_dir=out, resume_from=resume_from
    )
    return torch.load(out / "model.pt", weights_only=True), summary


class Runs:
    """Each layout's uninterrupted run, trained once for the module."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.done: dict[str, tuple[dict[str, torch.Tensor], dict[str, Any]]] = {}

    def __call__(self, layout: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        if layout not in self.done:
            self.done[layout] = train(self.root / layout, layout)
        return self.done[layout]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory.mktemp("runs"))


@pytest.fixture(scope="module")
def reference(runs: Runs) -> dict[str, torch.Tensor]:
    return runs("ddp1")[0]


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[n] - b[n]).abs().max().item() for n in a)


@pytest.mark.parametrize("layout", ["fsdp2", "tp2", "tp2xdp2", "hsdp2x2"])
def test_mesh_layout_matches_one_process_after_10_adamw_steps(
    runs: Runs, tmp_path: Path, reference: dict[str, torch.Tensor], layout: str
) -> None:
    weights, summary = runs(layout)
    assert max_difference(weights, reference) < 1e-5
    initial = _initial_weights(tmp_path)
    assert max_difference(reference, initial) > 1e-2, "training did not move the weights"
    assert summary["strategy"] == "fsdp" and summary["world_size"] == LAYOUTS[layout][0]


def test_fsdp_memory_per_rank_is_the_formulas_share(runs: Runs, tmp_path: Path) -> None:
    """fsdp over 4 ranks: each holds a quarter of fp32 weights, gradients and AdamW's
    moments, measured from its tensors (FSDP2 pads each parameter to a multiple of 4)."""
    _, summary = runs("fsdp4")
    held = summary["model_state_bytes"]
    cfg = config_from_dict(spec("fsdp4", tmp_path))
    formula = model_state(cfg, summary["params"]).per_worker
    measured = held["params"] + held["grads"] + held["optimizer"]
    assert measured == pytest.approx(formula, rel=0.02)
    fp32_weights = 4 * summary["params"]
    assert held["params"] == pytest.approx(fp32_weights / 4, rel=0.02)


def test_tp2xdp2_resume_after_a_killed_worker_is_bitwise_identical(
    runs: Runs, tmp_path: Path
) -> None:
    uninterrupted, _ = runs("tp2xdp2")
    faults = {"kill_at_steps": [6], "rank": 3}
    with pytest.raises(Exception, match="exit code 17"):
        train(tmp_path / "killed", "tp2xdp2", faults=faults)
    resumed, summary = train(tmp_path / "killed", "tp2xdp2", faults=faults)
    assert summary["resumed_from_step"] == 5  # killed in step 6, saved after every step
    for name, weight in uninterrupted.items():
        assert torch.equal(resumed[name], weight), name


def test_sharded_checkpoints_reshard_across_layouts_with_their_optimizer_state(
    runs: Runs, tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    """tp2×dp2 → fsdp 4 → ddp 1 → tp2 → hsdp 2×2, each hop resuming the previous run's
    checkpoint at a later step. Adam's moments must come through each hop: restarted
    moments would move every weight by about the learning rate (1e-2) at once."""
    chain = [("tp2xdp2", 0), ("fsdp4", 3), ("ddp1", 5), ("tp2", 7), ("hsdp2x2", 8)]
    runs("tp2xdp2")
    previous = runs.root / "tp2xdp2" / "runs" / "mesh-tp2xdp2"
    for layout, start in chain[1:]:
        out = tmp_path / layout
        weights, summary = train(out, layout, resume_from=previous / ckpt.dir_name(start))
        assert summary["resumed_from_step"] == start, layout
        notes = _start_notes(out)
        assert not any("re-initialised" in note for note in notes), (layout, notes)
        assert max_difference(weights, reference) < 1e-5, layout
        previous = out / "runs" / f"mesh-{layout}"


def _start_notes(out: Path) -> list[str]:
    for line in (out / "events.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("event") == "start":
            notes: list[str] = record["notes"]
            return notes
    raise AssertionError("no start event")


def _initial_weights(tmp_path: Path) -> dict[str, torch.Tensor]:
    from trainstack.models import build_model

    cfg = config_from_dict(spec("ddp1", tmp_path))
    model = build_model(cfg.model, vocab_size=cfg.data.vocab_size, seed=cfg.train.seed)
    return model.state_dict()
