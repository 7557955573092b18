"""Test-only fault injection: a worker process dies on purpose just before a chosen step
(and, with `faults.step_delay_s`, every step takes longer). With `faults.mid_save` it
dies while the checkpoint before that step is still being written in the background.

Driven by the spec's `faults` section (off by default). Each planned kill fires once
per run: a marker file in the run directory records it (`first_firing`, which the
parameter server's shards use for their planned kills too), so the steps replayed
after the restart do not kill again.
"""

from __future__ import annotations

import os
import random
import threading
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
        self.mid_save = cfg.faults.mid_save
        self.every_steps = cfg.checkpoint.every_steps

    def before_step(self, step: int, *, settle: Callable[[], None] | None = None) -> None:
        """Die now if this rank is planned to die before `step` and has not yet; sleep
        `faults.step_delay_s` first. `settle` runs just before a planned death: the
        checkpoint being written in the background lands first, so the run resumes from
        the step a test plans for (a real failure waits for nothing). Not with
        `faults.mid_save`: then that checkpoint is the one the death cuts short."""
        if self.delay_s:
            time.sleep(self.delay_s)
        if step not in self.plan:
            return
        if not first_firing(self.marker_dir / f"killed_before_step_{step}"):
            return  # fired in an earlier attempt; this is the replay
        if settle is not None and not self.mid_save:
            settle()
        self.on_fire(Fault(step=step, rank=self.rank).to_record())
        os._exit(17)

    def while_saving(self, step: int) -> None:
        """Called by the checkpoint writer of step `step` once this rank's files are
        written, before anything is committed. With `faults.mid_save`, where this rank
        dies before one of the next `checkpoint.every_steps` steps (and has not yet),
        the writer holds here for good: the death finds the save in flight."""
        if not self.mid_save:
            return
        for kill in self.plan:
            fired = (self.marker_dir / f"killed_before_step_{kill}").exists()
            if step < kill <= step + self.every_steps and not fired:
                threading.Event().wait()  # the process dies around this thread
