"""Pre-flight: everything about a job the driver can check before Ray starts.

The user's model target imports and builds (seeded, as the workers will build it),
`task.loss` imports, one micro-batch of the job's data goes through the model and the
task's loss (so an output of the wrong shape is one line here, not a worker
traceback), and the layout fits the model (pipeline layers, parameter-server shards).
Every problem is a `ConfigError`: one line, exit 2, nothing started.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from trainstack import checkpoint as ckpt
from trainstack.config import ConfigError, JobConfig
from trainstack.data import build_corpus, eval_batches
from trainstack.models import build_model, num_params
from trainstack.tasks import Task, TaskOutputError, build_task
from trainstack.user_code import describe_exception


@dataclass(frozen=True, kw_only=True)
class PreflightReport:
    """What the driver learnt about the job's model."""

    model_class: str
    params: int
    shapes: dict[str, list[int]]
    """State-dict names and shapes, which a checkpoint must match."""


def preflight(cfg: JobConfig) -> PreflightReport:
    """Check `cfg` against its model and data on the driver; raise ConfigError."""
    task = build_task(cfg)
    model = build_model(cfg.model, vocab_size=cfg.data.vocab_size, seed=cfg.train.seed)
    check_model_runs(cfg, model, task=task)
    if cfg.strategy.kind == "pipeline":
        from trainstack.strategies.pipeline_split import check_pipeline_model

        check_pipeline_model(cfg, model)
    if cfg.strategy.kind == "ps":
        check_shards(cfg, model)
    return PreflightReport(
        model_class=type(model).__name__,
        params=num_params(model),
        shapes=ckpt.parameter_shapes(model),
    )


def check_model_runs(cfg: JobConfig, model: nn.Module, *, task: Task) -> None:
    """One sample of the job's data through the model and the task's loss."""
    corpus = build_corpus(cfg.data)
    x, y = eval_batches(
        corpus, count=1, seq_len=cfg.model.block_size, micro_batch_size=1, rank=0, world_size=1
    )[0]
    where = cfg.model.target or cfg.model.kind
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            outputs = model(x)
    except Exception as e:
        raise ConfigError(
            f"model {where!r} failed on one input of shape {list(x.shape)} "
            f"({x.dtype}, from data.kind={cfg.data.kind}): {describe_exception(e)}"
        ) from None
    try:
        with torch.no_grad():
            task.loss(outputs, y, inputs=x)
    except TaskOutputError as e:
        raise ConfigError(f"model {where!r}: {e}") from None
    except Exception as e:
        what = f"task.loss={cfg.task.loss!r}" if cfg.task.loss else f"task.kind={cfg.task.kind}"
        raise ConfigError(
            f"{what} failed on the output of model {where!r}: {describe_exception(e)}"
        ) from None


def check_shards(cfg: JobConfig, model: nn.Module) -> None:
    """A parameter-server shard holds at least one parameter tensor."""
    tensors = len(list(model.parameters()))
    shards = cfg.strategy.num_shards
    if shards > tensors:
        raise ConfigError(
            f"strategy.num_shards={shards} is more than the model's {tensors} parameter "
            f"tensors; allowed: 1 to {tensors}"
        )
