"""The per-worker training loop: the same code under Ray Train and plain torch.distributed.

Read it top to bottom as the steps of a run: build data and model, hand them to the
strategy, step, log on log steps, evaluate on held-out data, summarise.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from trainstack.config import JobConfig
from trainstack.data import build_corpus
from trainstack.data.sharding import DataCursor, ShardedBatches, eval_batches
from trainstack.metrics import ThroughputMeter, device_peak_flops, mfu, peak_memory_bytes
from trainstack.models import build_model
from trainstack.strategies import Strategy, WorkerContext, build_strategy

LogFn = Callable[[dict[str, Any]], None]


@dataclass(frozen=True, kw_only=True)
class TrainOutcome:
    summary: dict[str, Any]
    """The run's figures; rank 0's are the ones reported."""
    strategy: Strategy
    """The trained strategy, holding the final model and optimizer state."""


def torch_threads(cfg: JobConfig) -> int:
    """Intra-op threads per worker: the CPUs it reserved, at least one."""
    return max(1, math.floor(cfg.scaling.cpus_per_worker))


def train(cfg: JobConfig, ctx: WorkerContext, *, on_log: LogFn | None = None) -> TrainOutcome:
    """Run the job on this worker; return its summary and the trained strategy.

    `on_log` is called on rank 0 at every log step with that step's metrics.
    """
    torch.set_num_threads(torch_threads(cfg))
    corpus = build_corpus(cfg.data)
    seq_len = cfg.model.block_size
    model = build_model(cfg.model, vocab_size=cfg.data.vocab_size, seed=cfg.train.seed)
    flops_per_token = model.flops_per_token()
    num_params = model.num_params()
    torch.manual_seed(cfg.train.seed + 1 + ctx.rank)  # dropout differs per rank, repeatably

    strategy = build_strategy(cfg, ctx)
    strategy.setup(model)
    batches = ShardedBatches(
        corpus=corpus,
        seq_len=seq_len,
        global_batch_size=cfg.train.global_batch_size,
        micro_batch_size=cfg.train.micro_batch_size,
        rank=ctx.rank,
        world_size=ctx.world_size,
        cursor=DataCursor(),
    )
    meter = ThroughputMeter(
        tokens_per_step=cfg.train.global_batch_size * seq_len,
        samples_per_step=cfg.train.global_batch_size,
    )
    peak_flops = device_peak_flops(ctx.device)

    def achieved_mfu(tokens_per_s: float) -> float | None:
        return mfu(
            flops_per_token=flops_per_token,
            tokens_per_s=tokens_per_s,
            peak_flops=peak_flops,
            world_size=ctx.world_size,
        )

    run_start = time.perf_counter()
    train_loss = math.nan
    for step in range(cfg.train.steps):
        step_start = time.perf_counter()
        out = strategy.train_step(batches.next_step())
        meter.record(time.perf_counter() - step_start)

        done = step + 1
        if done % cfg.log.every_steps == 0 or done == cfg.train.steps:
            train_loss = strategy.global_mean(out.loss)  # a collective: every rank calls it
            if ctx.rank == 0 and on_log is not None:
                window = meter.window()
                on_log(
                    {
                        "step": done,
                        "steps": cfg.train.steps,
                        "loss": train_loss,
                        "lr": out.lr,
                        "grad_norm": out.grad_norm,
                        **window,
                        "mfu": achieved_mfu(window["tokens_per_s"]),
                        "peak_mem_bytes": peak_memory_bytes(ctx.device),
                        "elapsed_s": time.perf_counter() - run_start,
                    }
                )
    train_s = time.perf_counter() - run_start

    eval_loss = None
    if cfg.data.eval_samples > 0:
        held_out = eval_batches(
            corpus,
            count=cfg.data.eval_samples,
            seq_len=seq_len,
            micro_batch_size=cfg.train.micro_batch_size,
            rank=ctx.rank,
            world_size=ctx.world_size,
        )
        loss_sum, tokens = strategy.eval_loss(held_out)
        eval_loss = loss_sum / tokens

    steady = meter.steady_state()
    summary = {
        "final_loss": eval_loss if eval_loss is not None else train_loss,
        "final_train_loss": train_loss,
        "eval_loss": eval_loss,
        "entropy_floor": corpus.loss_floor(seq_len),
        "steps": cfg.train.steps,
        "tokens_per_s": steady["tokens_per_s"],
        "samples_per_s": steady["samples_per_s"],
        "step_time_s": steady["step_time_s"],
        "step_time_p50_s": steady["step_time_p50_s"],
        "mfu": achieved_mfu(steady["tokens_per_s"]),
        "world_size": ctx.world_size,
        "strategy": cfg.strategy.kind,
        "device": ctx.device.type,
        "params": num_params,
        "flops_per_token": flops_per_token,
        "comm_bytes_per_step": strategy.comm_bytes_per_step(),
        "peak_mem_bytes": peak_memory_bytes(ctx.device),
        "train_s": train_s,
    }
    return TrainOutcome(summary=summary, strategy=strategy)
