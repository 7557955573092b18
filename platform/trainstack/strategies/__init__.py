"""Parallelism strategies, by the name a job spec's `strategy.kind` uses.

Each strategy's module is imported when a job asks for it: torch's pipelining, FSDP,
tensor-parallel and DeepSpeed modules cost every worker process seconds of start-up,
and a job uses one of them.
"""

from __future__ import annotations

from collections.abc import Callable

from trainstack.config import JobConfig
from trainstack.strategies.base import StepOutput, Strategy, WorkerContext


def _ddp(cfg: JobConfig, ctx: WorkerContext) -> Strategy:
    from trainstack.strategies.ddp import DDPStrategy

    return DDPStrategy(cfg, ctx)


def _zero(cfg: JobConfig, ctx: WorkerContext) -> Strategy:
    from trainstack.strategies.zero import ZeROStrategy

    return ZeROStrategy(cfg, ctx)


def _fsdp(cfg: JobConfig, ctx: WorkerContext) -> Strategy:
    from trainstack.strategies.fsdp import FSDPStrategy

    return FSDPStrategy(cfg, ctx)


def _pipeline(cfg: JobConfig, ctx: WorkerContext) -> Strategy:
    """`strategy.engine` picks the implementation."""
    if cfg.strategy.engine == "deepspeed":
        from trainstack.strategies.pipeline_deepspeed import DeepSpeedPipelineStrategy

        return DeepSpeedPipelineStrategy(cfg, ctx)
    from trainstack.strategies.pipeline import PipelineStrategy

    return PipelineStrategy(cfg, ctx)


STRATEGIES: dict[str, Callable[[JobConfig, WorkerContext], Strategy]] = {
    "ddp": _ddp,
    "zero": _zero,
    "fsdp": _fsdp,
    "pipeline": _pipeline,
}


def build_strategy(cfg: JobConfig, ctx: WorkerContext) -> Strategy:
    return STRATEGIES[cfg.strategy.kind](cfg, ctx)


__all__ = ["STRATEGIES", "StepOutput", "Strategy", "WorkerContext", "build_strategy"]
