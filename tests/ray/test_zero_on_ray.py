"""ZeRO on Ray: stage 3 (parameters sharded too) survives a killed worker and its
checkpoint exports. Recovery on Ray is the same for every stage; what differs per stage
is the checkpoint, and tests/dist/test_zero.py resumes stages 1, 2 and 3 bitwise after a
killed worker."""

from pathlib import Path

import pytest
import torch

from trainstack import checkpoint as ckpt
from trainstack.cli import main
from trainstack.config import config_from_dict
from trainstack.models import build_model
from trainstack.runtime.launcher import run_job


@pytest.mark.slow
@pytest.mark.parametrize("stage", [3])
def test_zero_stage_recovers_from_a_killed_worker(
    ray_cluster: None, tmp_path: Path, stage: int
) -> None:
    cfg = config_from_dict(
        {
            "name": f"zero{stage}-chaos",
            "model": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16},
            "data": {"vocab_size": 16, "order": 1, "eval_samples": 32},
            "train": {"steps": 12, "global_batch_size": 16, "micro_batch_size": 8},
            "optim": {"warmup_steps": 2},
            "strategy": {"kind": "zero", "stage": stage},
            "scaling": {"num_workers": 2},
            "checkpoint": {"every_steps": 4, "storage_path": str(tmp_path)},
            "failure": {"max_failures": 1},
            "log": {"every_steps": 4, "progress": "quiet"},
            "faults": {"kill_at_steps": [7], "rank": 1},
        }
    )
    summary = run_job(cfg)
    assert summary["restarts"] == 1 and summary["strategy"] == "zero"
    assert summary["recovery"] == [
        {"resumed_from_step": 4, "failed_after_step": 6, "steps_lost": 2}
    ]
    assert summary["model_state_bytes"]["optimizer"] > 0

    exported = tmp_path / "model.pt"
    assert main(["export", str(ckpt.run_dir_for(cfg)), "--out", str(exported)]) == 0
    weights = torch.load(exported, weights_only=True)
    model = build_model(cfg.model, vocab_size=cfg.data.vocab_size, seed=0)
    model.load_state_dict(weights)  # full fp32 weights, whatever the stage
    assert set(weights) == set(model.state_dict())
