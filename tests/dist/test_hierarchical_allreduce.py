"""Node-aware all-reduce: four gloo processes as 2 nodes × 2 ranks reduce each bucket
within the node, across the two leaders, and back, and train what one process trains
(float64, within `FP64_BOUND`), with the bytes that cross nodes counted and equal to
the formula: a leader sends 2(n − 1)/n of each bucket, one copy per node."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from trainstack.config import config_from_dict
from trainstack.models import build_model, num_params
from trainstack.runtime.gloo_processes import run_processes

from bounds import FP64_BOUND, assert_trained, max_difference, one_process


def spec(storage: Path, *, allreduce: str = "flat", workers: int = 1) -> dict[str, Any]:
    return {
        "name": "two-level",
        "model": {"n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 8},
        "data": {"vocab_size": 16, "order": 1, "eval_samples": 16},
        "train": {"steps": 10, "global_batch_size": 16, "micro_batch_size": 4, "precision": "fp64"},
        "optim": {"lr": 1e-2, "warmup_steps": 2, "grad_clip": 1.0, "weight_decay": 0.1},
        "strategy": {"kind": "ddp", "allreduce": allreduce, "bucket_cap_mb": 0.01},
        "scaling": {"num_workers": workers},
        "checkpoint": {"storage_path": str(storage / "runs")},
    }


@pytest.mark.parametrize("allreduce", ["hierarchical", "auto"])
def test_two_nodes_of_two_ranks_reduce_in_two_levels_and_train_what_one_process_trains(
    tmp_path: Path, allreduce: str
) -> None:
    reference = one_process(spec(tmp_path / "ref"), tmp_path / "ref")
    raw = spec(tmp_path / "nodes", allreduce=allreduce, workers=4)
    summary = run_processes(
        config_from_dict(raw), world_size=4, out_dir=tmp_path / "nodes", ranks_per_node=2
    )
    weights = torch.load(tmp_path / "nodes" / "model.pt", weights_only=True)
    diff = max_difference(weights, reference)
    print(f"{allreduce}: max |w - one process| = {diff:.3g}")
    assert diff < FP64_BOUND
    assert_trained(reference, raw)
    # Every gradient (float64, in several buckets) crosses once per step: 2(2 - 1)/2 of it.
    cfg = config_from_dict(raw)
    params = num_params(build_model(cfg.model, vocab_size=16, seed=0))
    assert summary["cross_node_bytes_per_step"] == 8 * params


def test_auto_stays_flat_when_every_rank_has_a_node_of_its_own(tmp_path: Path) -> None:
    raw = spec(tmp_path, allreduce="auto", workers=2)
    summary = run_processes(
        config_from_dict(raw), world_size=2, out_dir=tmp_path / "out", ranks_per_node=1
    )
    assert "cross_node_bytes_per_step" not in summary
