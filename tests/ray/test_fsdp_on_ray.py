"""fsdp with tensor parallelism on Ray: a tp2 × dp2 group survives a killed worker by
resuming its sharded checkpoint (every rank's DCP shards, collected by Ray Train into one
checkpoint), ends where one process ends (in float64, `tests/bounds.py`), and the
checkpoint exports those whole weights."""

from pathlib import Path

import pytest
import torch

from trainstack import checkpoint as ckpt
from trainstack.cli import main
from trainstack.config import config_from_dict
from trainstack.models import build_model
from trainstack.runtime.launcher import run_job

from bounds import FP64_BOUND, assert_trained, held_out_loss, max_difference, one_process


@pytest.mark.slow
def test_tp2_dp2_recovers_from_a_killed_worker_and_exports_what_one_process_trains(
    ray_cluster: None, tmp_path: Path
) -> None:
    raw = {
        "name": "tp2xdp2-chaos",
        "model": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16},
        "data": {"vocab_size": 16, "order": 1, "eval_samples": 32},
        "train": {"steps": 12, "global_batch_size": 16, "micro_batch_size": 8, "precision": "fp64"},
        "optim": {"lr": 1e-2, "warmup_steps": 2},
        "strategy": {"kind": "fsdp", "tensor_parallel": 2},
        "scaling": {"num_workers": 4},
        "checkpoint": {"every_steps": 4, "storage_path": str(tmp_path / "runs")},
        "failure": {"max_failures": 1},
        "log": {"every_steps": 4, "progress": "quiet"},
        "faults": {"kill_at_steps": [7], "rank": 1},
    }
    cfg = config_from_dict(raw)
    summary = run_job(cfg)
    assert summary["restarts"] == 1 and summary["strategy"] == "fsdp"
    assert summary["recovery"] == [
        {"resumed_from_step": 4, "failed_after_step": 6, "steps_lost": 2}
    ]
    final = ckpt.resolve(ckpt.run_dir_for(cfg))
    assert final.step == 12
    shards = [name for name in final.manifest["files"] if name.startswith("state/__")]
    assert len(shards) == 4 and final.has("state/.metadata")  # every rank's, verified

    exported = tmp_path / "model.pt"
    assert main(["export", str(ckpt.run_dir_for(cfg)), "--out", str(exported)]) == 0
    weights = torch.load(exported, weights_only=True)
    build_model(cfg.model, vocab_size=cfg.data.vocab_size, seed=0).load_state_dict(weights)
    # The kill, the resume from every rank's shards and the export change nothing: the
    # weights are one process's (a skipped shard, a wrong offset or a lost optimizer state
    # moves them by 1e-4 or more in as many steps), and the run evaluated those weights.
    reference = one_process(raw, tmp_path / "reference")
    diff = max_difference(weights, reference)
    print(f"max |tp2 x dp2 on Ray, killed once - one process| = {diff:.3g}")
    assert diff < FP64_BOUND
    assert_trained(reference, raw)
    assert summary["eval_loss"] == pytest.approx(held_out_loss(raw, weights), rel=1e-9)
