"""Pipeline × data parallel on Ray Train: the worker group builds the stages and their
replicas from its ranks and trains what one process trains (in float64, `tests/bounds.py`),
reporting each stage's bubble.

A killed stage worker on Ray is not repeated here: a sharded layout's every-rank
checkpoint surviving a restart on Ray is `test_fsdp_on_ray`'s, and the pipeline's exact
resume after a kill is `tests/dist/test_pipeline.py`'s."""

from pathlib import Path

import pytest

from trainstack import checkpoint as ckpt
from trainstack.config import config_from_dict
from trainstack.runtime.launcher import run_job

from bounds import FP64_BOUND, assert_trained, max_difference, one_process


@pytest.mark.slow
def test_pipeline_times_data_parallel_on_ray_trains_what_one_process_trains(
    ray_cluster: None, tmp_path: Path
) -> None:
    raw = {
        "name": "pipeline-dp",
        "model": {"n_layer": 4, "n_head": 2, "n_embd": 32, "block_size": 16},
        "data": {"vocab_size": 16, "order": 1, "eval_samples": 32},
        "train": {"steps": 10, "global_batch_size": 16, "micro_batch_size": 2, "precision": "fp64"},
        "optim": {"lr": 1e-2, "warmup_steps": 2},
        "strategy": {
            "kind": "pipeline",
            "schedule": "zbv",
            "stages": 2,
            "data_parallel": 2,
            "microbatches": 4,
        },
        "scaling": {"num_workers": 4, "cpus_per_worker": 0.5},
        "checkpoint": {"storage_path": str(tmp_path / "runs")},
        "log": {"every_steps": 5, "progress": "quiet"},
    }
    summary = run_job(config_from_dict(raw))
    assert summary["strategy"] == "pipeline" and summary["world_size"] == 4
    assert len(summary["pipeline"]["bubble_fraction_per_rank"]) == 2

    weights = ckpt.verify(Path(summary["final_checkpoint"])).full_weights()
    reference = one_process(raw, tmp_path / "reference")
    diff = max_difference(weights, reference)
    print(f"max |pipeline x dp on Ray - one process| = {diff:.3g}")
    assert diff < FP64_BOUND  # a wrong stage split or a skipped replica all-reduce: 1e-4 up
    assert_trained(reference, raw)
