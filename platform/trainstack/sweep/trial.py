"""One Tune trial: a trainstack run driven from inside the trial, its figures sent to Tune.

Train V2 does not run a `TorchTrainer` as a Tune trainable; the trial is a plain
function that calls `run_job` (which starts the Train worker group, or the parameter
server's actors) and forwards the run's log records with `tune.report`. ASHA compares
trials on `tokens` (training tokens seen), so trials with different batch sizes or
worker counts meet at equal data.

A trial's job is named `<sweep>-<trial id>` under the sweep's storage, so a retried or
resumed trial continues its own checkpoints and its own MLflow run.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ray import tune

from trainstack.config import JobConfig
from trainstack.sweep.spec import SweepConfig

COMPLETED = "completed"
"""Set to 1 in a trial's last report, sent once its run has finished."""
REPORTED = ("step", "loss", "eval_loss", "tokens_per_s", "elapsed_s", "mfu", "bytes_on_wire")


@dataclass(frozen=True, kw_only=True)
class TrialPlan:
    """What every trial needs from the sweep driver (sent to the trial actors)."""

    sweep: SweepConfig
    parent_run_id: str | None
    """The sweep's MLflow run; each trial's run is nested under it."""

    def job_name(self, trial_id: str) -> str:
        return f"{self.sweep.name}-{trial_id}"

    def run_dir(self, trial_id: str) -> Path:
        return self.sweep.sweep_dir / "runs" / self.job_name(trial_id)


def chosen_values(config: Mapping[str, Any]) -> dict[str, Any]:
    """The space's values in a trial's Tune config (see `tuning.param_space`)."""
    return {**config.get("grid", {}), **config.get("sampled", {})}


def trial_job(sweep: SweepConfig, overrides: Mapping[str, Any], *, name: str) -> JobConfig:
    """The job spec a trial trains: the base with the trial's values, and (objective
    eval_loss) the held-out loss logged on every log step, for ASHA to compare."""
    cfg = sweep.trial_config(overrides, name=name)
    if sweep.objective.metric == "eval_loss" and not cfg.log.eval_every_steps:
        cfg.log.eval_every_steps = cfg.log.every_steps
    return cfg


def run_trial(config: dict[str, Any], *, plan: TrialPlan) -> None:
    """The Tune trainable: train this trial's job spec and report as it goes."""
    from trainstack.runtime.launcher import run_job  # imports Ray Train: not at import time

    trial_id = tune.get_context().get_trial_id()
    sweep = plan.sweep
    overrides = sweep.trial_overrides(chosen_values(config))
    cfg = trial_job(sweep, overrides, name=plan.job_name(trial_id))
    tokens_per_step = cfg.train.global_batch_size * cfg.tokens_per_sample
    metric = sweep.objective.metric

    def on_record(record: dict[str, Any]) -> None:
        # The final step is reported from the summary below, with steady-state figures.
        if "event" in record or record["step"] >= cfg.train.steps or record.get(metric) is None:
            return
        tune.report(_numbers(record, tokens=record["step"] * tokens_per_step, completed=0))

    tags = {"trainstack.sweep": sweep.name, "trainstack.trial_id": trial_id}
    if plan.parent_run_id:
        tags["mlflow.parentRunId"] = plan.parent_run_id
    summary = run_job(cfg, on_record=on_record, tracking_tags=tags)
    run_bytes = summary.get("bytes_on_wire_run")  # warm-up included, where measured
    final = {
        **summary,
        **({"bytes_on_wire": run_bytes / summary["steps"]} if run_bytes else {}),
        "step": summary["steps"],
        "loss": summary.get("final_train_loss"),
        "elapsed_s": summary.get("train_s"),
    }
    tune.report(_numbers(final, tokens=summary["steps"] * tokens_per_step, completed=1))


def _numbers(record: Mapping[str, Any], *, tokens: int, completed: int) -> dict[str, Any]:
    """The figures Tune and ASHA see: finite numbers only (a missing one is NaN)."""
    out: dict[str, Any] = {"tokens": tokens, COMPLETED: completed}
    for key in REPORTED:
        value = record.get(key)
        if isinstance(value, int | float) and math.isfinite(value):
            out[key] = float(value)
        else:
            out[key] = math.nan
    return out
