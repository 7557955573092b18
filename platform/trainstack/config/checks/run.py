"""Checks of how the run goes: name, train, optim, scaling and elasticity, checkpoints,
faults, log, and the rules that span sections."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from trainstack.config.checks.allowed import (
    CORRUPT_CHECKPOINT_ACTIONS,
    LR_SCALINGS,
    LR_SCHEDULES,
    MAX_BATCH_SIZE,
    MAX_CHECKPOINTS_KEPT,
    MAX_CPUS_PER_WORKER,
    MAX_SEED,
    MAX_START_TIMEOUT_S,
    MAX_STEP_DELAY_S,
    MAX_STEPS,
    MAX_UPDATES,
    MAX_WORKERS,
    NAME_MAX_CHARS,
    NAME_PATTERN,
    OPTIM_KINDS,
    PRECISIONS,
    RAY_BUILTIN_RESOURCES,
)
from trainstack.config.checks.common import cap, check_choice, next_multiple, require
from trainstack.config.checks.model_data import validate_streaming
from trainstack.config.checks.strategy import validate_fp64
from trainstack.errors import ConfigError, show
from trainstack.kinds import data_kind_of, kind_of, kinds_that
from trainstack.storage import check_uri, is_store_uri
from trainstack.units import parse_quantity

if TYPE_CHECKING:
    from trainstack.config.sections import (
        CheckpointConfig,
        JobConfig,
        OptimConfig,
        ScalingConfig,
        TrainConfig,
    )


def validate_log(cfg: JobConfig) -> None:
    every, evals = cfg.log.every_steps, cfg.log.eval_every_steps
    require("log.every_steps", every >= 1, every, ">= 1")
    cap("log.every_steps", every, MAX_STEPS)
    cap("log.eval_every_steps", evals, MAX_STEPS)
    allowed = f"0 (only at the end) or a multiple of log.every_steps={every}"
    require("log.eval_every_steps", evals >= 0 and evals % every == 0, evals, allowed)


def validate_name(name: str) -> None:
    if len(name) > NAME_MAX_CHARS or not NAME_PATTERN.fullmatch(name):
        raise ConfigError(
            f"name={show(name)} is not a valid run name; allowed: letters, digits, '.', '_' "
            f"and '-', starting with a letter or digit, at most {NAME_MAX_CHARS} characters"
        )


def validate_train(t: TrainConfig) -> None:
    require("train.steps", t.steps >= 1, t.steps, ">= 1")
    cap("train.steps", t.steps, MAX_STEPS)
    require("train.global_batch_size", t.global_batch_size >= 1, t.global_batch_size, ">= 1")
    cap("train.global_batch_size", t.global_batch_size, MAX_BATCH_SIZE)
    require("train.micro_batch_size", t.micro_batch_size >= 1, t.micro_batch_size, ">= 1")
    cap("train.micro_batch_size", t.micro_batch_size, MAX_BATCH_SIZE)
    require("train.seed", 0 <= t.seed <= MAX_SEED, t.seed, f"0 to {MAX_SEED}")
    check_choice("train.precision", t.precision, PRECISIONS)


def validate_optim(o: OptimConfig) -> None:
    check_choice("optim.kind", o.kind, OPTIM_KINDS)
    require("optim.lr", o.lr > 0, o.lr, "> 0")
    require("optim.weight_decay", o.weight_decay >= 0, o.weight_decay, ">= 0")
    for i, beta in enumerate(o.betas):
        require(f"optim.betas[{i}]", 0 <= beta < 1, beta, "[0, 1)")
    require("optim.momentum", 0 <= o.momentum < 1, o.momentum, "[0, 1)")
    require("optim.warmup_steps", o.warmup_steps >= 0, o.warmup_steps, ">= 0")
    check_choice("optim.schedule", o.schedule, LR_SCHEDULES)
    require("optim.min_lr_ratio", 0 <= o.min_lr_ratio <= 1, o.min_lr_ratio, "[0, 1]")
    require("optim.grad_clip", o.grad_clip >= 0, o.grad_clip, ">= 0 (0 disables clipping)")
    check_choice("optim.lr_scaling", o.lr_scaling, LR_SCALINGS)


def validate_scaling(s: ScalingConfig) -> None:
    require("scaling.num_workers", s.num_workers >= 1, s.num_workers, ">= 1")
    if s.device_memory:
        parse_quantity("scaling.device_memory", s.device_memory, units=True, example="80GB")
    cap("scaling.num_workers", s.num_workers, MAX_WORKERS)
    require("scaling.cpus_per_worker", s.cpus_per_worker > 0, s.cpus_per_worker, "> 0")
    cap("scaling.cpus_per_worker", s.cpus_per_worker, MAX_CPUS_PER_WORKER)
    timeout = s.start_timeout_s
    require("scaling.start_timeout_s", timeout >= 0, timeout, ">= 0 (0: wait forever)")
    cap("scaling.start_timeout_s", timeout, MAX_START_TIMEOUT_S, why=" (0: wait forever)")
    fewest = f"0 (a fixed group) to scaling.num_workers={s.num_workers}"
    require("scaling.min_workers", 0 <= s.min_workers <= s.num_workers, s.min_workers, fewest)
    require("scaling.resize_check_s", s.resize_check_s > 0, s.resize_check_s, "> 0")
    cap("scaling.resize_check_s", s.resize_check_s, MAX_START_TIMEOUT_S)
    for name, amount in s.resources_per_worker.items():
        key = f"scaling.resources_per_worker.{name}"
        if name in RAY_BUILTIN_RESOURCES:
            raise ConfigError(
                f"{key}: CPUs and GPUs are set by scaling.cpus_per_worker and scaling.use_gpu; "
                "allowed here: custom resources the cluster's nodes advertise"
            )
        if isinstance(amount, bool) or not isinstance(amount, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {show(amount)}")
        require(key, amount > 0, float(amount), "> 0")
        cap(key, amount, MAX_CPUS_PER_WORKER)


def validate_elastic(cfg: JobConfig) -> None:
    """An elastic group (`scaling.min_workers` > 0) keeps the global batch at every size."""
    s, g = cfg.scaling, cfg.train.global_batch_size
    if not s.elastic:
        return
    sizes = f"{{min: {s.min_workers}, max: {s.num_workers}}}"
    if not kind_of(cfg).elastic:
        raise ConfigError(
            f"scaling.num_workers={sizes} with strategy.kind={cfg.strategy.kind}: elastic "
            f"scaling is for strategy.kind {kinds_that(lambda k: k.elastic, last=' or ')} (a "
            "pipeline could resize only by whole replicas; a parameter server keeps its "
            "workers); give num_workers a number"
        )
    if data_kind_of(cfg).streams:
        raise ConfigError(
            f"scaling.num_workers={sizes} with data.kind={cfg.data.kind}: Ray Data's shards are "
            "fixed per group; elastic scaling needs an indexed source (markov, tokens, text, "
            "arrays, ...)"
        )
    misfits = [n for n in range(s.min_workers, s.num_workers + 1) if g % n]
    if misfits:
        every = math.lcm(*range(s.min_workers, s.num_workers + 1))
        raise ConfigError(
            f"train.global_batch_size={g} must be divisible by every worker count of "
            f"scaling.num_workers={sizes} (the global batch stays fixed as the group resizes); "
            f"{misfits[0]} does not divide it; allowed: a multiple of {every}, "
            f"e.g. {next_multiple(g, every)}"
        )


def validate_checkpoint(c: CheckpointConfig) -> None:
    require(
        "checkpoint.every_steps", c.every_steps >= 0, c.every_steps, ">= 0 (0: only at the end)"
    )
    cap("checkpoint.every_steps", c.every_steps, MAX_STEPS)
    require("checkpoint.keep", c.keep >= 1, c.keep, ">= 1")
    cap("checkpoint.keep", c.keep, MAX_CHECKPOINTS_KEPT)
    if not c.storage_path.strip():
        raise ConfigError(f"checkpoint.storage_path={c.storage_path!r} is empty; allowed: a path")
    if is_store_uri(c.storage_path):
        check_uri(c.storage_path, c.storage_options)  # offline: the store is probed in preflight
    elif c.storage_options:
        raise ConfigError(
            f"checkpoint.storage_options={show(c.storage_options)} needs an object store in "
            f"checkpoint.storage_path (got the path {show(c.storage_path)}); allowed: "
            "s3://bucket/prefix, gs://bucket/prefix, or no storage_options"
        )
    check_choice("checkpoint.on_corrupt", c.on_corrupt, CORRUPT_CHECKPOINT_ACTIONS)


def validate_object_store(cfg: JobConfig) -> None:
    """What cannot keep its files in an object store yet."""
    kind = kind_of(cfg)
    if not kind.object_store_checkpoints and is_store_uri(cfg.checkpoint.storage_path):
        raise ConfigError(
            f"checkpoint.storage_path={show(cfg.checkpoint.storage_path)}: strategy.kind="
            f"{kind.name} keeps its shard checkpoints in a shared filesystem, not an object store; "
            "allowed: a path every node mounts (e.g. NFS), or strategy.kind "
            f"{kinds_that(lambda k: k.object_store_checkpoints and k.runs_on == 'ray_train')}"
        )


def validate_faults(cfg: JobConfig) -> None:
    f, steps, workers = cfg.faults, cfg.train.steps, cfg.scaling.num_workers
    for i, step in enumerate(f.kill_at_steps):
        require(f"faults.kill_at_steps[{i}]", 1 <= step <= steps, step, f"1 to {steps}")
    require("faults.random_kills", 0 <= f.random_kills < steps, f.random_kills, f"0 to {steps - 1}")
    require("faults.rank", -1 <= f.rank < workers, f.rank, f"-1 (random) to {workers - 1}")
    for i, update in enumerate(f.kill_shard_at_updates):
        where = f"faults.kill_shard_at_updates[{i}]"
        require(where, 1 <= update <= MAX_UPDATES, update, f"1 to {MAX_UPDATES:,}")
    require("faults.seed", 0 <= f.seed <= MAX_SEED, f.seed, f"0 to {MAX_SEED}")
    cap("faults.shard", f.shard, MAX_WORKERS)  # ps: checked against its shards too
    cap("faults.slow_rank", f.slow_rank, MAX_WORKERS)
    delay = f.step_delay_s
    require(
        "faults.step_delay_s", 0 <= delay <= MAX_STEP_DELAY_S, delay, f"0 to {MAX_STEP_DELAY_S}"
    )
    if f.mid_save and not (cfg.checkpoint.async_save and cfg.checkpoint.every_steps > 0):
        raise ConfigError(
            "faults.mid_save=true needs a save in flight; allowed: with "
            "checkpoint.async_save=true and checkpoint.every_steps > 0, or faults.mid_save=false"
        )


def validate_cross_section(cfg: JobConfig) -> None:
    validate_streaming(cfg)
    validate_fp64(cfg)
    validate_object_store(cfg)
    validate_elastic(cfg)
    t, o = cfg.train, cfg.optim
    replicas = cfg.data_parallel_size
    per_step = t.micro_batch_size * replicas
    what = {
        "pipeline": "strategy.data_parallel",
        "fsdp": "(scaling.num_workers / strategy.tensor_parallel)",
    }.get(cfg.strategy.kind, "scaling.num_workers")
    if t.global_batch_size % per_step and not cfg.scaling.elastic:  # elastic: micro adapts
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} is not divisible by "
            f"train.micro_batch_size × {what} = {t.micro_batch_size} × "
            f"{replicas} = {per_step}; allowed: a multiple of {per_step}, "
            f"e.g. {next_multiple(t.global_batch_size, per_step)}"
        )
    if o.warmup_steps >= t.steps:
        raise ConfigError(
            f"optim.warmup_steps={o.warmup_steps} must be less than train.steps={t.steps}; "
            f"allowed: 0 to {t.steps - 1}"
        )
