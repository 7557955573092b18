"""Parallelism strategies; `trainstack.kinds` names the class each
`strategy.kind` builds.

Each strategy's module is imported when a job asks for it: torch's pipelining, FSDP,
tensor-parallel and DeepSpeed modules cost every worker process seconds of start-up,
and a job uses one of them.
"""

from __future__ import annotations

from trainstack.config import JobConfig
from trainstack.kinds import kind_of
from trainstack.strategies.base import StepOutput, Strategy, WorkerContext


def build_pipeline(cfg: JobConfig, ctx: WorkerContext) -> Strategy:
    """`strategy.engine` picks the implementation."""
    if cfg.strategy.engine == "deepspeed":
        from trainstack.strategies.pipeline_deepspeed import DeepSpeedPipelineStrategy

        return DeepSpeedPipelineStrategy(cfg, ctx)
    from trainstack.strategies.pipeline import PipelineStrategy

    return PipelineStrategy(cfg, ctx)


def build_strategy(cfg: JobConfig, ctx: WorkerContext) -> Strategy:
    """The spec's strategy on this worker, built by what its kind's entry names."""
    kind = kind_of(cfg)
    if not kind.build:
        raise ValueError(f"strategy.kind={kind.name} does not run as a worker group's strategy")
    strategy: Strategy = kind.builder()(cfg, ctx)
    return strategy


__all__ = ["StepOutput", "Strategy", "WorkerContext", "build_pipeline", "build_strategy"]
