"""How fast a run recovers from a dead worker, and how much work it loses.

DDP on 2 CPU workers; the test-only fault injector kills rank 1 just before one step
(mid-way between two checkpoints, the average case). From the run's events:

    detection      kill -> the Train controller reports the worker failure
    group restart  detection -> the new worker group enters the training loop
    load           loop entry -> model built and checkpoint restored
    first step     restored -> first optimizer step completed
    steps lost     steps done before the kill that had to be redone

    python benchmarks/recovery.py --every 10 --kill-at 26
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from trainstack.config import load_config
from trainstack.runtime.launcher import run_job

ROOT = Path(__file__).resolve().parents[1]


def measure(*, every: int, kill_at: int, steps: int) -> dict[str, Any]:
    storage = Path(tempfile.mkdtemp(prefix="trainstack-recovery-"))
    cfg = load_config(
        str(ROOT / "jobs/configs/demo.yaml"),
        [
            "name=recovery",
            f"train.steps={steps}",
            f"checkpoint.every_steps={every}",
            f"checkpoint.storage_path={storage}",
            "failure.max_failures=1",
            f"faults.kill_at_steps=[{kill_at}]",
            "faults.rank=1",
            "log.progress=quiet",
            "log.every_steps=5",
        ],
    )
    events: list[dict[str, Any]] = []
    summary = run_job(cfg, on_record=events.append)
    shutil.rmtree(storage, ignore_errors=True)
    fault = next(e for e in events if e.get("event") == "fault")
    failure = next(e for e in events if e.get("event") == "failure")
    restart = [e for e in events if e.get("event") == "start"][1]
    first = [e for e in events if e.get("event") == "first_step"][1]
    return {
        "every_steps": every,
        "killed_before_step": kill_at,
        "resumed_from_step": restart["resumed_from_step"],
        "steps_lost": kill_at - 1 - restart["resumed_from_step"],
        "detection_s": failure["time"] - fault["time"],
        "group_restart_s": restart["worker_entered"] - failure["time"],
        "load_s": restart["time"] - restart["worker_entered"],
        "first_step_s": first["time"] - restart["time"],
        "kill_to_first_step_s": first["time"] - fault["time"],
        "restarts": summary["restarts"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--kill-at", type=int, default=26)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", default=str(ROOT / ".cache/bench/recovery.json"))
    args = parser.parse_args()
    row = measure(every=args.every, kill_at=args.kill_at, steps=args.steps)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(row, indent=2))
    for key, value in row.items():
        print(f"{key:>22}  {value:.2f}" if isinstance(value, float) else f"{key:>22}  {value}")


if __name__ == "__main__":
    main()
