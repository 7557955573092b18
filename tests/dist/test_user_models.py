"""Models that are not trainstack's own train to the single-process reference under
DDP and ZeRO-3: the example package's CNN (`classify`), its custom transformer
(`lm`) and a Hugging Face Llama (`hf`); the Llama also resumes bitwise after a kill.

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
from trainstack.models import build_model
from trainstack.runtime.local import run_processes

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
        "train": {"steps": STEPS, "global_batch_size": 16, "micro_batch_size": 16 // workers},
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
    """Each model on 1 DDP worker (the reference), 2 DDP workers and 2 ZeRO-3 workers."""
    root = tmp_path_factory.mktemp("user-models")
    out: dict[str, Run] = {}
    for model in MODELS:
        for strategy, workers in (("ddp", 1), ("ddp", 2), ("zero", 2)):
            key = f"{model}-{strategy}{workers}"
            out[key] = Run(spec(model, root / key, strategy=strategy, workers=workers), root / key)
    return out


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[n].float() - b[n].float()).abs().max().item() for n in a)


@pytest.mark.parametrize("model", list(MODELS))
def test_ddp_on_two_workers_matches_one_process(runs: dict[str, Run], model: str) -> None:
    reference, ddp = runs[f"{model}-ddp1"], runs[f"{model}-ddp2"]
    diff = max_diff(ddp.weights, reference.weights)
    print(f"{model}: max |ddp2 - ddp1| = {diff:.3g}")
    assert diff <= 1e-5
    cfg = config_from_dict(reference.raw)
    initial = build_model(cfg.model, vocab_size=cfg.data.vocab_size, seed=cfg.train.seed)
    moved = max_diff(reference.weights, initial.state_dict())
    assert moved > 1e-2, "training did not change the weights: the comparison proves nothing"


@pytest.mark.parametrize("model", list(MODELS))
def test_zero3_matches_ddp(runs: dict[str, Run], model: str) -> None:
    ddp, zero = runs[f"{model}-ddp2"], runs[f"{model}-zero2"]
    diff = max_diff(zero.weights, ddp.weights)
    print(f"{model}: max |zero3 - ddp| = {diff:.3g}")
    assert diff <= 1e-5
    ddp_losses, zero_losses = ddp.losses(), zero.losses()
    assert all(abs(zero_losses[s] - ddp_losses[s]) < 1e-4 for s in ddp_losses)


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
