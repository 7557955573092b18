"""Models that are not trainstack's own train to the single-process reference under
DDP and ZeRO-3: the example package's CNN (`classify`), its custom transformer
(`lm`) and a Hugging Face Llama (`hf`); the Llama also resumes bitwise after a kill.
DDP is held to one process in float64, ZeRO-3 (float32 only) to the reference's own
float32 sensitivity (`tests/bounds.py`).

The example package (examples/user_models) reaches the worker processes through
PYTHONPATH, as it would a user's (tests/conftest.py puts examples/ there).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from trainstack import checkpoint as ckpt
from trainstack.config import config_from_dict
from trainstack.runtime.gloo_processes import run_processes

from bounds import (
    FP64_BOUND,
    assert_trained,
    float32_sensitivity,
    max_difference,
    sensitivity_bound,
)
from user_model_specs import MODELS

REPO = Path(__file__).resolve().parents[2]
STEPS = 10


@pytest.fixture(scope="module", autouse=True)
def torch_extensions_dir() -> Iterator[None]:
    previous = os.environ.get("TORCH_EXTENSIONS_DIR")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
    yield
    if previous is None:
        os.environ.pop("TORCH_EXTENSIONS_DIR", None)


def spec(
    model: str, storage: Path, *, strategy: str = "ddp", workers: int = 2, kill: int = 0
) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "name": f"{model}-{strategy}{workers}",
        **MODELS[model],
        "train": {
            "steps": STEPS,
            "global_batch_size": 16,
            "micro_batch_size": 16 // workers,
            "precision": "fp32" if strategy == "zero" else "fp64",
        },
        "optim": {"lr": 1e-2, "warmup_steps": 2, "grad_clip": 1.0, "weight_decay": 0.1},
        "strategy": {"kind": strategy, "stage": 3},
        "scaling": {"num_workers": workers},
        "checkpoint": {"every_steps": 5, "keep": 5, "storage_path": str(storage)},
        "log": {"every_steps": 1},
        "faults": {"kill_at_steps": [kill], "rank": 1} if kill else {},
    }
    if strategy == "zero":
        # Partition every parameter: by default ZeRO-3 keeps ones under 1e5 elements whole.
        raw["deepspeed"] = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}
    return raw


class Run:
    def __init__(self, raw: dict[str, Any], out: Path) -> None:
        self.raw, self.out = raw, out
        workers = raw["scaling"]["num_workers"]
        self.summary = run_processes(config_from_dict(raw), world_size=workers, out_dir=out)
        cfg = config_from_dict(raw)
        final = ckpt.verify(ckpt.run_dir_for(cfg) / ckpt.dir_name(STEPS))
        self.weights: dict[str, torch.Tensor] = final.full_weights()

    def losses(self) -> dict[int, float]:
        """Training loss per step; a replayed step keeps its latest value."""
        lines = (self.out / "events.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines]
        return {r["step"]: r["loss"] for r in records if "event" not in r}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """Each model on 1 DDP worker (the reference), 2 DDP workers (both float64) and 2
    ZeRO-3 workers (float32)."""
    root = tmp_path_factory.mktemp("user-models")
    out: dict[str, Run] = {}
    for model in MODELS:
        for strategy, workers in (("ddp", 1), ("ddp", 2), ("zero", 2)):
            key = f"{model}-{strategy}{workers}"
            out[key] = Run(spec(model, root / key, strategy=strategy, workers=workers), root / key)
    return out


@pytest.mark.parametrize("model", list(MODELS))
def test_ddp_on_two_workers_matches_one_process(runs: dict[str, Run], model: str) -> None:
    reference, ddp = runs[f"{model}-ddp1"], runs[f"{model}-ddp2"]
    diff = max_difference(ddp.weights, reference.weights)
    print(f"{model}: max |ddp2 - ddp1| = {diff:.3g}")
    assert diff < FP64_BOUND
    assert_trained(reference.weights, reference.raw)


@pytest.mark.parametrize("model", list(MODELS))
def test_zero3_matches_ddp(runs: dict[str, Run], model: str, tmp_path: Path) -> None:
    zero = runs[f"{model}-zero2"]
    reference, sensitivity = float32_sensitivity(runs[f"{model}-ddp1"].raw, tmp_path)
    bound = sensitivity_bound(sensitivity)
    diff = max_difference(zero.weights, reference)
    print(f"{model}: max |zero3 - one process| = {diff:.3g} (bound {bound:.3g})")
    assert diff < bound
    # Each step's logged loss is the group's mean: the one process's float32 run's.
    events = (tmp_path / "reference" / "events.jsonl").read_text().splitlines()
    one = {r["step"]: r["loss"] for r in map(json.loads, events) if "event" not in r}
    zero_losses = zero.losses()
    assert zero_losses.keys() == one.keys()
    assert all(abs(zero_losses[s] - one[s]) < 1e-4 for s in one)


def test_held_out_metrics_follow_the_task(runs: dict[str, Run]) -> None:
    cnn, lm = runs["cnn-ddp2"].summary, runs["llama-ddp2"].summary
    assert cnn["task"] == "classify" and 0 <= cnn["eval_accuracy"] <= 1
    assert "eval_perplexity" not in cnn
    assert lm["task"] == "lm"
    assert lm["eval_perplexity"] == pytest.approx(torch.tensor(lm["eval_loss"]).exp().item())
    assert lm["eval_bits_per_token"] == pytest.approx(lm["eval_loss"] / 0.6931471805599453)
    # No flops_per_token() on these models: the FLOPs were counted, and are positive.
    assert cnn["flops_per_token"] > 0 and lm["flops_per_token"] > 0


def test_llama_resumes_bitwise_after_a_killed_worker(runs: dict[str, Run], tmp_path: Path) -> None:
    raw = spec("llama", tmp_path, kill=8)
    with pytest.raises(Exception, match="exit code 17"):
        run_processes(config_from_dict(raw), world_size=2, out_dir=tmp_path / "out")
    resumed = Run(raw, tmp_path / "out")  # the same command again resumes from step 5
    assert resumed.summary["resumed_from_step"] == 5
    uninterrupted = runs["llama-ddp2"]
    assert resumed.losses() == uninterrupted.losses()
    for name, value in uninterrupted.weights.items():
        assert torch.equal(resumed.weights[name], value), name


@pytest.mark.parametrize("trained_by", ["llama-ddp1", "llama-zero2"])
def test_export_hf_dir_loads_in_transformers_with_the_trained_logits(
    runs: dict[str, Run], tmp_path: Path, trained_by: str
) -> None:
    """`trainstack export RUN --out model.pt --hf-dir DIR` of the trained Llama, from one
    DDP process's checkpoint and from ZeRO-3's (its parameters partitioned over 2 ranks):
    the folder `AutoModelForCausalLM.from_pretrained` loads gives the trained model's
    logits (not the untrained one's)."""
    from transformers import AutoModelForCausalLM

    from trainstack.cli import main
    from trainstack.models import build_model

    run = runs[trained_by]
    cfg = config_from_dict(run.raw)
    final = ckpt.run_dir_for(cfg) / ckpt.dir_name(STEPS)
    out, hf_dir = tmp_path / "model.pt", tmp_path / "hf"
    assert main(["export", str(final), "--out", str(out), "--hf-dir", str(hf_dir)]) == 0

    loaded = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    trained = build_model(cfg.model, vocab_size=cfg.data.vocab_size, seed=0)
    trained.load_state_dict(torch.load(out, weights_only=True))
    untrained = build_model(cfg.model, vocab_size=cfg.data.vocab_size, seed=0)
    x = torch.randint(0, cfg.data.vocab_size, (2, cfg.model.block_size))

    def logits(model: torch.nn.Module) -> torch.Tensor:
        with torch.no_grad():
            outputs = model.eval()(x)
        return getattr(outputs, "logits", outputs)

    assert torch.allclose(logits(loaded), logits(trained), atol=1e-6, rtol=0)
    assert not torch.allclose(logits(loaded), logits(untrained), atol=1e-3, rtol=0)
