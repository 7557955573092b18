"""`model.fused_loss` under data-parallel layouts: the head's cross-entropy computed in
chunks, without the logits, trains what one process with plain logits trains (float64,
within `FP64_BOUND`), under DDP and under FSDP (whose head gathers its weight for it),
with two micro-batches a step on each rank (the loss scaled by 1/2)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from trainstack.config import config_from_dict
from trainstack.runtime.gloo_processes import run_processes

from bounds import FP64_BOUND, assert_trained, max_difference, one_process


def spec(storage: Path, *, fused: bool, strategy: str = "ddp", workers: int = 1) -> dict[str, Any]:
    return {
        "name": "fused-loss",
        "model": {"n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 8, "fused_loss": fused},
        "data": {"vocab_size": 16, "order": 1, "eval_samples": 16},
        "train": {"steps": 10, "global_batch_size": 16, "micro_batch_size": 4, "precision": "fp64"},
        "optim": {"lr": 1e-2, "warmup_steps": 2, "grad_clip": 1.0, "weight_decay": 0.1},
        "strategy": {"kind": strategy},
        "scaling": {"num_workers": workers},
        "checkpoint": {"storage_path": str(storage / "runs")},
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    out = tmp_path_factory.mktemp("plain")
    return one_process(spec(out, fused=False), out)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_fused_head_loss_on_two_ranks_trains_what_plain_logits_train_in_one(
    tmp_path: Path, reference: dict[str, torch.Tensor], strategy: str
) -> None:
    raw = spec(tmp_path / "fused", fused=True, strategy=strategy, workers=2)
    run_processes(config_from_dict(raw), world_size=2, out_dir=tmp_path / "fused")
    weights = torch.load(tmp_path / "fused" / "model.pt", weights_only=True)
    diff = max_difference(weights, reference)
    print(f"{strategy} fused vs one process plain: {diff:.3g}")
    assert diff < FP64_BOUND
    assert_trained(reference, raw)
