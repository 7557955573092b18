"""Parallelism strategies, by the name a job spec's `strategy.kind` uses."""

from __future__ import annotations

from collections.abc import Callable

from trainstack.config import JobConfig
from trainstack.strategies.base import Batch, StepOutput, Strategy, WorkerContext
from trainstack.strategies.ddp import DDPStrategy
from trainstack.strategies.zero import ZeROStrategy

STRATEGIES: dict[str, Callable[[JobConfig, WorkerContext], Strategy]] = {
    "ddp": DDPStrategy,
    "zero": ZeROStrategy,
}


def build_strategy(cfg: JobConfig, ctx: WorkerContext) -> Strategy:
    return STRATEGIES[cfg.strategy.kind](cfg, ctx)


__all__ = ["STRATEGIES", "Batch", "StepOutput", "Strategy", "WorkerContext", "build_strategy"]
