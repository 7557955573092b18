"""GPU path: NCCL + bf16 through trainstack on Ray; skipped without CUDA (see the device tool)."""

from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

ROOT = Path(__file__).resolve().parents[2]


def test_bf16_ddp_on_gpu_reports_mfu(tmp_path: Path) -> None:
    import ray

    from trainstack.config import load_config
    from trainstack.runtime.launcher import run_job

    workers = torch.cuda.device_count()
    cfg = load_config(
        str(ROOT / "jobs/configs/demo.yaml"),
        [
            "scaling.use_gpu=true",
            f"scaling.num_workers={workers}",
            "train.precision=bf16",
            "train.steps=50",
            f"train.global_batch_size={32 * workers}",
            f"checkpoint.storage_path={tmp_path}",
            "log.progress=quiet",
        ],
    )
    try:
        summary = run_job(cfg)
    finally:
        ray.shutdown()
    assert summary["device"] == "cuda"
    assert summary["final_loss"] < 1.5 * summary["entropy_floor"]
    # None would mean a GPU missing from metrics.PEAK_FLOPS: add it there.
    assert summary["mfu"] is not None, f"no peak FLOP/s for {torch.cuda.get_device_name()}"
    assert 0 < summary["mfu"] < 1
