"""Your own model on Ray: the parameter server trains the example CNN, custom
transformer and a Hugging Face Llama as synchronous SGD does (BSP = one process within
1e-5), and the example CNN learns the clusters task under DDP on a worker group to
near its Bayes accuracy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from trainstack import checkpoint as ckpt
from trainstack.config import config_from_dict
from trainstack.data import build_corpus
from trainstack.models import build_model
from trainstack.ps.driver import run_parameter_server
from trainstack.runtime.launcher import run_job
from trainstack.runtime.local import run_processes

from user_model_specs import MODELS


def ps_spec(model: str, storage: Path) -> dict[str, Any]:
    return {
        "name": f"ps-{model}",
        **MODELS[model],
        "train": {"steps": 10, "global_batch_size": 16, "micro_batch_size": 8},
        "optim": {"lr": 1e-2, "warmup_steps": 2, "grad_clip": 0, "weight_decay": 0.1},
        "strategy": {"kind": "ps", "num_shards": 2, "consistency": "bsp"},
        "scaling": {"num_workers": 2, "cpus_per_worker": 1},
        "checkpoint": {"storage_path": str(storage)},
        "log": {"every_steps": 5, "progress": "quiet"},
    }


@pytest.mark.parametrize("model", list(MODELS))
def test_parameter_server_bsp_matches_one_process(
    ray_cluster: None, tmp_path: Path, model: str
) -> None:
    summary = run_parameter_server(config_from_dict(ps_spec(model, tmp_path / "ps")))
    reference = ps_spec(model, tmp_path / "ref")
    reference["strategy"] = {"kind": "ddp"}
    reference["scaling"] = {"num_workers": 1}
    run_processes(config_from_dict(reference), world_size=1, out_dir=tmp_path / "ref-out")
    expected = torch.load(tmp_path / "ref-out" / "model.pt", weights_only=True)
    got = ckpt.verify(Path(summary["final_checkpoint"])).full_weights()
    assert got.keys() == expected.keys()
    diff = max((got[k] - expected[k]).abs().max().item() for k in expected)
    print(f"{model}: max |ps bsp - one process| = {diff:.3g}")
    assert diff < 1e-5
    cfg = config_from_dict(reference)
    initial = build_model(cfg.model, vocab_size=cfg.data.vocab_size, seed=cfg.train.seed)
    moved = max((expected[k] - v).abs().max().item() for k, v in initial.state_dict().items())
    assert moved > 1e-2, "training did not change the weights: the comparison proves nothing"
    assert summary["task"] == MODELS[model].get("task", {}).get("kind", "lm")


@pytest.mark.slow
def test_example_cnn_learns_the_clusters_task_under_ddp(ray_cluster: None, tmp_path: Path) -> None:
    raw = {
        "name": "cnn-clusters",
        **MODELS["cnn"],
        "data": {**MODELS["cnn"]["data"], "eval_samples": 512},
        "train": {"steps": 150, "global_batch_size": 64, "micro_batch_size": 32},
        "optim": {"lr": 3e-3, "warmup_steps": 10},
        "scaling": {"num_workers": 2},
        "checkpoint": {"storage_path": str(tmp_path)},
        "log": {"every_steps": 50, "progress": "quiet"},
    }
    cfg = config_from_dict(raw)
    summary = run_job(cfg)
    bayes = build_corpus(cfg.data).bayes_accuracy(cfg.data.eval_samples)
    # Chance is 10%; the ideal classifier (the true templates) gets `bayes` on these
    # very samples. A trained CNN comes within 3 points of it.
    print(f"held-out accuracy {summary['eval_accuracy']:.4f}, Bayes {bayes:.4f}")
    assert summary["eval_accuracy"] >= bayes - 0.03
    assert summary["eval_loss"] < summary["entropy_floor"] + 0.15
