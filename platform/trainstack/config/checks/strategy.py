"""Checks of the layout: strategy, pipelines, the parameter server, DeepSpeed, compression
and float64 training."""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING

from trainstack.config.checks.allowed import (
    ALLREDUCE_MODES,
    COMPRESSION_KINDS,
    DEEPSPEED_CONFIG_KEYS,
    DEEPSPEED_DERIVED_KEYS,
    DEEPSPEED_DERIVED_ZERO_KEYS,
    MAX_BATCH_SIZE,
    MAX_BUCKET_MB,
    MAX_CPUS_PER_WORKER,
    MAX_NUMEL,
    MAX_SLOW_FACTOR,
    MAX_STEPS,
    MAX_UPDATES,
    MAX_VIRTUAL_STAGES,
    MAX_WIDTH,
    MAX_WORKERS,
    OFFLOAD_DEVICES,
    PIPELINE_ENGINES,
    PIPELINE_SCHEDULES,
    PS_CONSISTENCY,
    PS_LOCAL_SERVERS,
    PS_STALENESS_LR,
    QSGD_BITS,
    STRATEGY_KINDS,
)
from trainstack.config.checks.common import cap, check_choice, require
from trainstack.errors import ConfigError
from trainstack.kinds import KINDS, kind_of, kinds_that, model_kind_of

if TYPE_CHECKING:
    from trainstack.config.sections import (
        JobConfig,
    )


def validate_strategy(cfg: JobConfig) -> None:
    s = cfg.strategy
    check_choice("strategy.kind", s.kind, STRATEGY_KINDS)
    require("strategy.bucket_cap_mb", s.bucket_cap_mb > 0, s.bucket_cap_mb, "> 0")
    cap("strategy.bucket_cap_mb", s.bucket_cap_mb, MAX_BUCKET_MB)
    require("strategy.stage", 1 <= s.stage <= 3, s.stage, "1, 2 or 3")
    check_choice("strategy.offload_optimizer", s.offload_optimizer, OFFLOAD_DEVICES)
    check_choice("strategy.offload_param", s.offload_param, OFFLOAD_DEVICES)
    require("strategy.reduce_bucket_size", s.reduce_bucket_size > 0, s.reduce_bucket_size, "> 0")
    cap("strategy.reduce_bucket_size", s.reduce_bucket_size, MAX_NUMEL)
    offload = kind_of(cfg).offload_param
    if s.offload_param != "none" and offload == "no":
        raise ConfigError(
            f"strategy.offload_param={s.offload_param} is for strategy.kind "
            f"{kinds_that(lambda k: k.offload_param != 'no', last=' or ')}; got "
            f"strategy.kind={s.kind} (leave it at none)"
        )
    if s.offload_param != "none" and offload == "stage 3" and s.stage != 3:
        raise ConfigError(
            f"strategy.offload_param={s.offload_param} needs strategy.stage=3 "
            f"(ZeRO-3 shards parameters); got stage {s.stage}"
        )
    if s.offload_optimizer != "none" and cfg.optim.kind != "adamw":
        raise ConfigError(
            f"strategy.offload_optimizer={s.offload_optimizer} needs optim.kind=adamw "
            f"(DeepSpeed's CPU Adam runs the offloaded step); got {cfg.optim.kind}"
        )
    if cfg.deepspeed:
        validate_deepspeed(cfg)
    validate_allreduce(cfg)


def validate_allreduce(cfg: JobConfig) -> None:
    """`strategy.allreduce` other than flat is a DDP communication hook of its own."""
    mode = cfg.strategy.allreduce
    check_choice("strategy.allreduce", mode, ALLREDUCE_MODES)
    if mode == "flat":
        return
    if not kind_of(cfg).dense_hooks:
        raise ConfigError(
            f"strategy.allreduce={mode} with strategy.kind={cfg.strategy.kind}: node-aware "
            f"all-reduce is for strategy.kind {kinds_that(lambda k: k.dense_hooks)}; "
            "allowed here: flat"
        )
    if cfg.compression.kind == "auto":
        raise ConfigError(
            f"strategy.allreduce={mode} with compression.kind=auto: the adaptive controller "
            "models a flat all-reduce's link; allowed: allreduce flat, or a fixed "
            "compression kind (it compresses the inter-node level)"
        )


def validate_pipeline(cfg: JobConfig) -> None:
    s, m = cfg.strategy, cfg.model
    check_choice("strategy.schedule", s.schedule, PIPELINE_SCHEDULES)
    check_choice("strategy.engine", s.engine, PIPELINE_ENGINES)
    require("strategy.stages", s.stages >= 2, s.stages, ">= 2 (one stage: use ddp)")
    cap("strategy.stages", s.stages, MAX_WORKERS)
    require("strategy.microbatches", s.microbatches >= 1, s.microbatches, ">= 1")
    cap("strategy.microbatches", s.microbatches, MAX_BATCH_SIZE)
    require("strategy.virtual_stages", s.virtual_stages >= 0, s.virtual_stages, ">= 0")
    cap("strategy.virtual_stages", s.virtual_stages, MAX_VIRTUAL_STAGES)
    require("strategy.data_parallel", s.data_parallel >= 1, s.data_parallel, ">= 1")
    cap("strategy.data_parallel", s.data_parallel, MAX_WORKERS)
    if kind_of(cfg).ranks != "pipeline":
        return
    p, d, v = s.stages, s.data_parallel, cfg.pipeline_virtual_stages
    if not model_kind_of(cfg).pipeline_layers:
        raise ConfigError(
            "strategy.kind=pipeline cuts a model into its pipeline layers; model.kind="
            f"{m.kind} has none (use gpt, hf, or a custom model with pipeline_layers())"
        )
    t = s.tensor_parallel
    if cfg.scaling.num_workers != p * d * t:
        raise ConfigError(
            f"scaling.num_workers={cfg.scaling.num_workers} must equal strategy.stages × "
            f"strategy.data_parallel × strategy.tensor_parallel = {p} × {d} × {t} = {p * d * t}"
        )
    if s.engine == "deepspeed":
        validate_deepspeed_pipeline(cfg)
        return
    if s.schedule in ("gpipe", "1f1b") and v != 1:
        raise ConfigError(
            f"strategy.virtual_stages={v} needs an interleaved schedule; "
            f"strategy.schedule={s.schedule} runs one stage per rank (allowed: 0 or 1)"
        )
    if s.schedule in ("interleaved", "zb_interleaved") and v < 2:
        raise ConfigError(
            f"strategy.virtual_stages={v} is out of range for strategy.schedule={s.schedule}; "
            "allowed: >= 2 stages per rank (one per rank: use 1f1b)"
        )
    if s.schedule in ("zbv", "dualpipev") and v != 2:
        raise ConfigError(
            f"strategy.virtual_stages={v} is out of range for strategy.schedule={s.schedule}; "
            "allowed: 0 or 2 (the V shape puts exactly two stages on each rank)"
        )
    if model_kind_of(cfg).shape_in_spec and p * v > m.n_layer:
        raise ConfigError(
            f"model.n_layer={m.n_layer} cannot be split into strategy.stages × virtual_stages "
            f"= {p} × {v} = {p * v} stages of at least one block; allowed: n_layer >= {p * v}"
        )
    if s.schedule in ("interleaved", "zb_interleaved") and s.microbatches % p:
        raise ConfigError(
            f"strategy.microbatches={s.microbatches} must be a multiple of "
            f"strategy.stages={p} for strategy.schedule={s.schedule}"
        )
    if s.schedule == "dualpipev" and s.microbatches < 2 * p:
        raise ConfigError(
            f"strategy.microbatches={s.microbatches} is out of range for "
            f"strategy.schedule=dualpipev; allowed: >= 2 × strategy.stages = {2 * p}"
        )
    validate_pipeline_batch(cfg)


def validate_parameter_server(cfg: JobConfig) -> None:
    s = cfg.strategy
    check_choice("strategy.consistency", s.consistency, PS_CONSISTENCY)
    check_choice("strategy.staleness_lr", s.staleness_lr, PS_STALENESS_LR)
    require("strategy.num_shards", s.num_shards >= 1, s.num_shards, ">= 1")
    cap("strategy.num_shards", s.num_shards, MAX_WORKERS)
    require("strategy.staleness_bound", s.staleness_bound >= 0, s.staleness_bound, ">= 0")
    cap("strategy.staleness_bound", s.staleness_bound, MAX_UPDATES)
    require("strategy.staleness_alpha", s.staleness_alpha >= 0, s.staleness_alpha, ">= 0")
    require("strategy.pull_every", s.pull_every >= 1, s.pull_every, ">= 1")
    cap("strategy.pull_every", s.pull_every, MAX_STEPS)
    require(
        "strategy.checkpoint_every_updates",
        s.checkpoint_every_updates >= 1,
        s.checkpoint_every_updates,
        ">= 1",
    )
    cap("strategy.checkpoint_every_updates", s.checkpoint_every_updates, MAX_UPDATES)
    auto = "-1 (auto: 0 on one machine, 1 on a multi-node cluster) or >= 0"
    require("strategy.ps_cpus", s.ps_cpus == -1 or s.ps_cpus >= 0, s.ps_cpus, auto)
    cap("strategy.ps_cpus", s.ps_cpus, MAX_CPUS_PER_WORKER)
    validate_local_servers(cfg)
    f = cfg.faults
    require("faults.slow_factor", f.slow_factor >= 1, f.slow_factor, ">= 1")
    cap("faults.slow_factor", f.slow_factor, MAX_SLOW_FACTOR)
    if kind_of(cfg).runs_on != "actors":  # what follows is the parameter server's
        return
    if s.staleness_bound and s.consistency != "ssp" and not s.reject_beyond_bound:
        raise ConfigError(
            f"strategy.staleness_bound={s.staleness_bound} needs strategy.consistency=ssp "
            f"(a clock bound) or strategy.reject_beyond_bound=true; got {s.consistency}"
        )
    if s.consistency == "bsp" and s.pull_every != 1:
        raise ConfigError(
            f"strategy.pull_every={s.pull_every} is out of range for strategy.consistency=bsp; "
            "allowed: 1 (every round starts from the parameters it produced)"
        )
    if s.reject_beyond_bound and s.consistency == "bsp":
        raise ConfigError(
            "strategy.reject_beyond_bound=true needs strategy.consistency=async or ssp; "
            "bsp pushes are never stale"
        )
    if cfg.optim.grad_clip:
        raise ConfigError(
            f"optim.grad_clip={cfg.optim.grad_clip} is not supported with strategy.kind=ps "
            "(no shard sees the whole gradient); set optim.grad_clip=0"
        )
    # More shards than parameter tensors: refused once the model is built, before Ray
    # starts (runtime/preflight.py); the spec alone does not know the model.
    workers = cfg.scaling.num_workers
    require("faults.slow_rank", -1 <= f.slow_rank < workers, f.slow_rank, f"-1 to {workers - 1}")
    require("faults.shard", 0 <= f.shard < s.num_shards, f.shard, f"0 to {s.num_shards - 1}")


def validate_local_servers(cfg: JobConfig) -> None:
    """`strategy.local_servers` and the two keys that tune it."""
    s = cfg.strategy
    text = s.local_servers
    count = int(text) if text.isascii() and text.isdigit() else None
    require(
        "strategy.local_servers",
        text in ("none", "per_node") or bool(count),
        text,
        PS_LOCAL_SERVERS,
    )
    if count is not None:
        workers = cfg.scaling.num_workers
        require(
            "strategy.local_servers",
            count <= workers,
            text,
            f"at most scaling.num_workers={workers}",
        )
    require("strategy.sync_every", s.sync_every >= 1, s.sync_every, ">= 1")
    cap("strategy.sync_every", s.sync_every, MAX_UPDATES)
    require(
        "strategy.max_local_staleness", s.max_local_staleness >= 0, s.max_local_staleness, ">= 0"
    )
    cap("strategy.max_local_staleness", s.max_local_staleness, MAX_STEPS)
    tuned = (s.sync_every, s.max_local_staleness) != (1, 0)
    if tuned and text == "none":
        raise ConfigError(
            f"strategy.sync_every={s.sync_every} and max_local_staleness={s.max_local_staleness} "
            "tune local servers, but strategy.local_servers=none; allowed: per_node or a "
            "count, or sync_every 1 and max_local_staleness 0"
        )
    if tuned and s.consistency == "bsp":
        raise ConfigError(
            f"strategy.sync_every={s.sync_every} and max_local_staleness={s.max_local_staleness} "
            "with strategy.consistency=bsp: a bsp local server sends each clock and serves "
            "each clock's parameters; allowed: sync_every 1 and max_local_staleness 0"
        )


def validate_deepspeed_pipeline(cfg: JobConfig) -> None:
    s, m = cfg.strategy, cfg.model
    if cfg.train.precision != "fp32":
        raise ConfigError(
            f"train.precision={cfg.train.precision} with strategy.engine=deepspeed: its "
            "pipelines train in fp32 here; allowed: fp32, or engine torch for bf16 autocast"
        )
    if cfg.train.compile:
        raise ConfigError(
            "train.compile=true compiles the blocks of the torch engine's stages; "
            "strategy.engine=deepspeed builds its own (use engine torch, or compile false)"
        )
    if s.schedule != "1f1b" or cfg.pipeline_virtual_stages != 1:
        raise ConfigError(
            f"strategy.schedule={s.schedule} (virtual_stages {cfg.pipeline_virtual_stages}) "
            "is not what strategy.engine=deepspeed runs; allowed: schedule 1f1b with one "
            "stage per rank (DeepSpeed's PipelineEngine has its own 1F1B-style schedule)"
        )
    if model_kind_of(cfg).shape_in_spec and s.stages > m.n_layer:
        raise ConfigError(
            f"model.n_layer={m.n_layer} cannot be split into strategy.stages={s.stages} "
            f"stages of at least one block; allowed: n_layer >= {s.stages}"
        )
    stage = cfg.deepspeed.get("zero_optimization", {}).get("stage", 0)
    if stage not in (0, 1):
        raise ConfigError(
            f"deepspeed.zero_optimization.stage={stage} is refused with strategy.engine="
            "deepspeed: DeepSpeed's pipeline engine supports ZeRO stage 0 or 1 only"
        )
    validate_pipeline_batch(cfg)


def validate_pipeline_batch(cfg: JobConfig) -> None:
    s, t = cfg.strategy, cfg.train
    replicas = s.data_parallel * s.microbatches
    if t.global_batch_size % replicas:
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} is not divisible by "
            f"strategy.data_parallel × microbatches = {s.data_parallel} × {s.microbatches}"
        )
    wanted = t.global_batch_size // replicas
    if t.micro_batch_size != wanted:
        raise ConfigError(
            f"train.micro_batch_size={t.micro_batch_size} must be global_batch_size / "
            f"(data_parallel × microbatches) = {t.global_batch_size} / ({s.data_parallel} × "
            f"{s.microbatches}) = {wanted} with strategy.kind=pipeline; set it to {wanted}"
        )


def validate_deepspeed(cfg: JobConfig) -> None:
    """`deepspeed:` is for DeepSpeed keys trainstack does not derive, where DeepSpeed
    trains: ZeRO (whose `zero_optimization` trainstack derives) or a kind whose
    `strategy.engine` is deepspeed (the pipeline engine, which takes it from here)."""
    raw, kind = cfg.deepspeed, kind_of(cfg)
    if kind.engine_of(cfg) != "deepspeed":
        raise ConfigError(
            "deepspeed: raw DeepSpeed keys apply only with strategy.kind=zero or "
            f"strategy.engine=deepspeed; got strategy.kind={kind.name}"
        )
    derives_zero = kind.engine == "deepspeed"
    for key in raw:
        if key in DEEPSPEED_DERIVED_KEYS:
            raise ConfigError(
                f"deepspeed.{key} is derived from the job spec; set "
                f"{DEEPSPEED_DERIVED_KEYS[key]} instead"
            )
        if key not in DEEPSPEED_CONFIG_KEYS:
            close = difflib.get_close_matches(str(key), DEEPSPEED_CONFIG_KEYS, n=1)
            hint = f"; did you mean 'deepspeed.{close[0]}'?" if close else ""
            raise ConfigError(f"unknown DeepSpeed key 'deepspeed.{key}'{hint}")
    zero = raw.get("zero_optimization")
    if not isinstance(zero, dict) or not derives_zero:
        return
    for key, value in zero.items():
        if key not in DEEPSPEED_DERIVED_ZERO_KEYS:
            continue
        shown = key
        if key.startswith("offload_"):
            if isinstance(value, dict) and "device" not in value:
                continue  # sub-options (pin_memory, nvme_path, ...) pass; the device is ours
            shown = f"{key}.device"
        raise ConfigError(
            f"deepspeed.zero_optimization.{shown} is derived from the job spec; "
            f"set strategy.{key} instead"
        )
    if cfg.model.pretrained and cfg.strategy.stage == 3:
        validate_pretrained_zero3(zero)


def validate_pretrained_zero3(zero: dict[str, object]) -> None:
    """ZeRO-3 reads `model.pretrained` into each parameter's partition alone: a second
    copy that DeepSpeed would cut from the whole parameter (hpZ's secondary partition, a
    quantized one) would start unfilled."""
    for key, off in (
        ("zero_hpz_partition_size", 1),
        ("zero_quantized_weights", False),
        ("zero_quantized_nontrainable_weights", False),
    ):
        if zero.get(key, off) != off:
            raise ConfigError(
                f"deepspeed.zero_optimization.{key}={zero[key]} with model.pretrained under "
                f"strategy.stage=3: each rank reads the pretrained weights into its own "
                f"partition, not into that second copy; allowed: {off} (or leave it out)"
            )


def validate_compression(cfg: JobConfig) -> None:
    c = cfg.compression
    check_choice("compression.kind", c.kind, COMPRESSION_KINDS)
    require("compression.ratio", 0 < c.ratio <= 1, c.ratio, "(0, 1]")
    bits_allowed = ", ".join(str(b) for b in QSGD_BITS)
    require("compression.bits", c.bits in QSGD_BITS, c.bits, bits_allowed)
    require("compression.rank", c.rank >= 1, c.rank, ">= 1")
    cap("compression.rank", c.rank, MAX_WIDTH)
    require("compression.min_numel", c.min_numel >= 0, c.min_numel, ">= 0")
    cap("compression.min_numel", c.min_numel, MAX_NUMEL)
    require(
        "compression.auto_link_gbit", c.auto_link_gbit >= 0, c.auto_link_gbit, ">= 0 (0: measure)"
    )
    if c.auto_link_gbit and c.kind != "auto":
        raise ConfigError(
            "compression.auto_link_gbit models the link for kind auto; "
            f"compression.kind is {c.kind}"
        )
    kind = kind_of(cfg)
    if c.kind == "auto" and not kind.dense_hooks:
        raise ConfigError(
            f"compression.kind=auto adapts a DDP hook to the network; strategy.kind is "
            f"{kind.name} (allowed: {kinds_that(lambda k: k.dense_hooks)}, or a fixed kind "
            "such as topk where the strategy compresses)"
        )
    if c.kind != "none" and not kind.compresses:
        raise ConfigError(
            f"compression.kind={c.kind} needs strategy.kind="
            f"{kinds_that(lambda k: k.compresses, last=' or ')}; got {kind.name}"
        )
    steps = cfg.train.steps
    require(
        "compression.warmup_steps",
        0 <= c.warmup_steps < steps,
        c.warmup_steps,
        f"0 to train.steps - 1 = {steps - 1}",
    )
    # momentum_correction is on by default, so it is not refused where it does not apply
    for key, on in (("local_clip", c.local_clip), ("warmup_steps", c.warmup_steps > 0)):
        if on and c.kind in ("none", "fp16", "bf16"):
            raise ConfigError(
                f"compression.{key} applies to lossy compression (topk, randk, qsgd, sign, "
                f"powersgd); compression.kind is {c.kind}"
            )
        if on and not kind.dense_hooks:
            raise ConfigError(
                f"compression.{key} is a DDP hook's; strategy.kind={kind.name} compresses "
                f"without it (allowed: strategy.kind {kinds_that(lambda k: k.dense_hooks)})"
            )
    if c.local_clip and not cfg.optim.grad_clip:
        raise ConfigError(
            "compression.local_clip clips each rank's gradient to optim.grad_clip, which is 0 "
            "(off); set optim.grad_clip > 0 or local_clip: false"
        )


def validate_fp64(cfg: JobConfig) -> None:
    """fp64 is the torch engines' (DeepSpeed trains in fp32/bf16, the parameter server's
    wire is float32, the codecs pack float32)."""
    if cfg.train.precision != "fp64":
        return
    kind = kind_of(cfg)
    if not kind.float64 or kind.engine_of(cfg) != "torch":
        engine = kind.name
        if kind.engine == "strategy.engine":
            engine += f" engine {cfg.strategy.engine}"
        allowed = [k.name for k in KINDS.values() if k.float64]
        raise ConfigError(
            f"train.precision=fp64 with strategy.kind={engine}: float64 training runs on "
            f"the torch engines only; allowed: strategy.kind {', '.join(allowed)} (engine "
            "torch), or precision fp32 / bf16"
        )
    if cfg.compression.kind != "none":
        raise ConfigError(
            f"train.precision=fp64 with compression.kind={cfg.compression.kind}: the codecs "
            "encode float32 gradients; allowed: compression.kind none, or precision fp32"
        )
