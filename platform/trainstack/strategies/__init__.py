"""Parallelism strategies, by the name a job spec's `strategy.kind` uses."""

from __future__ import annotations

from collections.abc import Callable

from trainstack.config import JobConfig
from trainstack.strategies.base import StepOutput, Strategy, WorkerContext
from trainstack.strategies.ddp import DDPStrategy
from trainstack.strategies.fsdp import FSDPStrategy
from trainstack.strategies.pipeline import PipelineStrategy
from trainstack.strategies.zero import ZeROStrategy

STRATEGIES: dict[str, Callable[[JobConfig, WorkerContext], Strategy]] = {
    "ddp": DDPStrategy,
    "zero": ZeROStrategy,
    "fsdp": FSDPStrategy,
    "pipeline": lambda cfg, ctx: _pipeline(cfg, ctx),
}


def _pipeline(cfg: JobConfig, ctx: WorkerContext) -> Strategy:
    """`strategy.engine` picks the implementation; DeepSpeed is imported only if asked."""
    if cfg.strategy.engine == "deepspeed":
        from trainstack.strategies.pipeline_deepspeed import DeepSpeedPipelineStrategy

        return DeepSpeedPipelineStrategy(cfg, ctx)
    return PipelineStrategy(cfg, ctx)


def build_strategy(cfg: JobConfig, ctx: WorkerContext) -> Strategy:
    return STRATEGIES[cfg.strategy.kind](cfg, ctx)


__all__ = ["STRATEGIES", "StepOutput", "Strategy", "WorkerContext", "build_strategy"]
