"""Test-only fault injection: a worker process dies on purpose just before a chosen step
(and, with `faults.step_delay_s`, every step takes longer).

Driven by the spec's `faults` section (off by default). Each planned kill fires once
per run: a marker file in the run directory records it (`first_firing`, which the
parameter server's shards use for their planned kills too), so the steps replayed
after the restart do not kill again.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainstack.config import JobConfig
from trainstack.run_events import Fault


def kill_plan(cfg: JobConfig) -> dict[int, int]:
    """Step (1-based) -> the rank that dies just before it."""
    faults = cfg.faults
    rng = random.Random(faults.seed)
    steps = set(faults.kill_at_steps)
    candidates = sorted(set(range(2, cfg.train.steps + 1)) - steps)
    steps.update(rng.sample(candidates, min(faults.random_kills, len(candidates))))
    plan = {}
    for step in sorted(steps):
        rank = faults.rank if faults.rank >= 0 else rng.randrange(cfg.scaling.num_workers)
        plan[step] = rank
    return plan


def first_firing(marker: Path) -> bool:
    """Create `marker`, a planned kill's record; False if it exists already (an earlier
    attempt of this run fired that kill, and this is the replay)."""
    marker.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return False
    return True


class FaultInjector:
    def __init__(
        self,
        cfg: JobConfig,
        *,
        rank: int,
        marker_dir: Path,
        on_fire: Callable[[dict[str, Any]], None],
    ) -> None:
        self.plan = {s: r for s, r in kill_plan(cfg).items() if r == rank}
        self.rank = rank
        self.marker_dir = marker_dir
        self.on_fire = on_fire
        self.delay_s = cfg.faults.step_delay_s

    def before_step(self, step: int, *, settle: Callable[[], None] | None = None) -> None:
        """Die now if this rank is planned to die before `step` and has not yet; sleep
        `faults.step_delay_s` first. `settle` runs just before a planned death: the
        checkpoint being written in the background lands first, so the run resumes from
        the step a test plans for (a real failure waits for nothing)."""
        if self.delay_s:
            time.sleep(self.delay_s)
        if step not in self.plan:
            return
        if not first_firing(self.marker_dir / f"killed_before_step_{step}"):
            return  # fired in an earlier attempt; this is the replay
        if settle is not None:
            settle()
        self.on_fire(Fault(step=step, rank=self.rank).to_record())
        os._exit(17)
