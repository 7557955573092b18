"""Parallelism strategies, by the name a job spec's `strategy.kind` uses."""

from __future__ import annotations

from trainstack.config import JobConfig
from trainstack.strategies.base import Batch, StepOutput, Strategy, WorkerContext
from trainstack.strategies.ddp import DDPStrategy

STRATEGIES: dict[str, type[DDPStrategy]] = {"ddp": DDPStrategy}


def build_strategy(cfg: JobConfig, ctx: WorkerContext) -> Strategy:
    return STRATEGIES[cfg.strategy.kind](cfg, ctx)


__all__ = ["STRATEGIES", "Batch", "StepOutput", "Strategy", "WorkerContext", "build_strategy"]
