"""The demo job trains through a Ray Train worker group down to the data's entropy floor."""

import io
import json
from pathlib import Path

from trainstack.config import load_config
from trainstack.runtime.launcher import run_job
from trainstack.runtime.progress import ProgressDisplay

ROOT = Path(__file__).resolve().parents[2]


def test_demo_variant_reaches_entropy_floor_on_two_workers(
    ray_cluster: None, tmp_path: Path
) -> None:
    cfg = load_config(
        str(ROOT / "jobs/configs/demo.yaml"),
        [
            "name=demo-short",
            "train.steps=120",
            "data.vocab_size=16",
            "data.order=1",
            "log.every_steps=20",
            f"checkpoint.storage_path={tmp_path}",
        ],
    )
    stream = io.StringIO()
    summary = run_job(cfg, display=ProgressDisplay(mode="jsonl", stream=stream))

    assert summary["world_size"] == 2 and summary["strategy"] == "ddp"
    assert summary["steps"] == 120
    floor = summary["entropy_floor"]
    assert 0 < floor < summary["final_loss"] <= 1.10 * floor
    assert summary["tokens_per_s"] > 0 and summary["samples_per_s"] > 0
    assert summary["mfu"] is None  # CPU: no known peak FLOP/s
    assert summary["wall_s"] > summary["train_s"] > 0

    records = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [r["step"] for r in records] == [20, 40, 60, 80, 100, 120]
    assert records[-1]["loss"] < records[0]["loss"]
    assert all(r["tokens_per_s"] > 0 and r["peak_mem_bytes"] > 0 for r in records)
