"""Validation of the job spec: ranges, allowed values and cross-section rules.

Every check raises `ConfigError` with one line: the dotted key, the value, what is
allowed and, where it helps, a hint. The allowed-value tuples live here too.
"""

from __future__ import annotations

import difflib
import math
import re
from typing import TYPE_CHECKING, Any

from trainstack.config_layout import validate_mesh
from trainstack.errors import ConfigError, show
from trainstack.kinds import DATA_KINDS as DATA_KIND_TABLE
from trainstack.kinds import KINDS, kind_of, kinds_that
from trainstack.kinds import MODEL_KINDS as MODEL_KIND_TABLE
from trainstack.storage import check_uri, is_store_uri
from trainstack.units import parse_quantity

if TYPE_CHECKING:
    from trainstack.config import (
        CheckpointConfig,
        DataConfig,
        JobConfig,
        ModelConfig,
        OptimConfig,
        ScalingConfig,
        TrainConfig,
    )

# ---- allowed values (other modules may extend these) ---------------------------

MODEL_KINDS: tuple[str, ...] = tuple(MODEL_KIND_TABLE)
BUILTIN_MODEL_KINDS: tuple[str, ...] = tuple(k.name for k in MODEL_KIND_TABLE.values() if k.builtin)
"""Models whose structure the spec alone determines; the others are built to be known."""
TASK_KINDS: tuple[str, ...] = ("lm", "classify")
DATA_KINDS: tuple[str, ...] = tuple(DATA_KIND_TABLE)
DATA_TASKS: dict[str, str] = {k.name: k.task for k in DATA_KIND_TABLE.values() if k.task}
"""The task each data source's samples are for (custom serves either)."""
TOKEN_DTYPES: tuple[str, ...] = ("auto", "uint16", "uint32")
RAY_FORMATS: tuple[str, ...] = ("parquet", "json", "text")
IMPORT_PATH = re.compile(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*")
"""`package.module:attribute`, the form of model.target and task.loss."""
MAX_CLASSES = 1000
MAX_INPUT_NUMEL = 2**20
MAX_TEMPLATE_NUMEL = 2**25
"""clusters: class templates are held whole (float64), so classes × input size is bounded."""
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp64")
OPTIM_KINDS: tuple[str, ...] = ("adamw", "sgd")
LR_SCHEDULES: tuple[str, ...] = ("cosine", "linear", "constant")
LR_SCALINGS: tuple[str, ...] = ("none", "linear", "sqrt")
STRATEGY_KINDS: tuple[str, ...] = tuple(KINDS)
PS_CONSISTENCY: tuple[str, ...] = ("async", "ssp", "bsp")
PS_STALENESS_LR: tuple[str, ...] = ("none", "inverse")
PIPELINE_SCHEDULES: tuple[str, ...] = (
    "gpipe",
    "1f1b",
    "interleaved",
    "zb_interleaved",
    "zbv",
    "dualpipev",
)
PIPELINE_ENGINES: tuple[str, ...] = ("torch", "deepspeed")
COMPRESSION_KINDS: tuple[str, ...] = (
    "none",
    "fp16",
    "bf16",
    "topk",
    "randk",
    "qsgd",
    "sign",
    "powersgd",
    "auto",
)
QSGD_BITS: tuple[int, ...] = (2, 4, 8)
OFFLOAD_DEVICES: tuple[str, ...] = ("none", "cpu")

# Top-level keys DeepSpeed 0.19.8 reads from its config, collected once from its
# source: every key `DeepSpeedConfig._initialize_params` (deepspeed/runtime/config.py,
# constants in deepspeed/runtime/constants.py) and its sub-configs look up, plus the
# ones `deepspeed.initialize` reads (data_parallel_size, sequence_parallel_size).
DEEPSPEED_CONFIG_KEYS: tuple[str, ...] = (
    "activation_checkpointing",
    "aio",
    "amp",
    "autotuning",
    "bf16",
    "bfloat16",
    "checkpoint",
    "comet",
    "comms_logger",
    "communication_data_type",
    "compile",
    "compression_training",
    "csv_monitor",
    "curriculum_learning",
    "data_efficiency",
    "data_parallel_size",
    "data_types",
    "dataloader_drop_last",
    "datastates_ckpt",
    "disable_allgather",
    "disable_python_gc",
    "dump_state",
    "eigenvalue",
    "elasticity",
    "expert_parallel",
    "flops_profiler",
    "fp16",
    "gradient_accumulation_steps",
    "gradient_allreduce_op",
    "gradient_clipping",
    "gradient_predivide_factor",
    "graph_harvesting",
    "hybrid_engine",
    "log_level",
    "managed_gradient_accumulation",
    "memory_breakdown",
    "nebula",
    "optimizer",
    "pipeline",
    "prescale_gradients",
    "progressive_layer_drop",
    "quantize_training",
    "scheduler",
    "seq_parallel_communication_data_type",
    "sequence_parallel_size",
    "sparse_attention",
    "sparse_gradients",
    "steps_per_print",
    "tensor_parallel",
    "tensorboard",
    "timers",
    "torch_autocast",
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "use_data_before_expert_parallelism",
    "vocabulary_size",
    "wall_clock_breakdown",
    "wandb",
    "weight_quantization",
    "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer",
    "zero_optimization",
)
# DeepSpeed keys the zero strategy derives from the spec -> the spec key to set instead.
DEEPSPEED_DERIVED_KEYS: dict[str, str] = {
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.global_batch_size (accumulation follows from it)",
    "train_batch_size": "train.global_batch_size",
    "optimizer": "optim.kind and the optim section",
    "scheduler": "optim.schedule and the optim section",
    "gradient_clipping": "optim.grad_clip",
    "bf16": "train.precision",
    "bfloat16": "train.precision",
    "fp16": "train.precision",
}
DEEPSPEED_DERIVED_ZERO_KEYS: tuple[str, ...] = (
    "stage",
    "offload_optimizer",
    "offload_param",
    "overlap_comm",
    "reduce_bucket_size",
)
TRACKING_BACKENDS: tuple[str, ...] = ("mlflow", "none")
CORRUPT_CHECKPOINT_ACTIONS: tuple[str, ...] = ("fail", "restart")
PROGRESS_MODES: tuple[str, ...] = ("auto", "bar", "lines", "jsonl", "quiet")

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
NAME_MAX_CHARS = 100
MAX_BLOCK_SIZE = 8192
MAX_VOCAB_SIZE = 2**22
"""Above any real tokenizer's (262,144 is the largest in common use); ids past 65,535
are stored as uint32 token files."""
MAX_MARKOV_ORDER = 3
MAX_MARKOV_STATES = 2**20
MAX_SEED = 2**32 - 1
# Ceilings of every count in the spec: generous for any real run, and far below the
# values (1e30 steps, 1e5-wide layers) that would only fail later, in a worker.
MAX_STEPS = 10**9
"""Steps, and every cadence or distance counted in steps."""
MAX_BATCH_SIZE = 2**24
"""Samples in a global batch, a micro-batch, or micro-batches per pipeline step."""
MAX_WORKERS = 10_000
"""World size: workers, pipeline stages and replicas, parameter-server shards."""
MAX_UPDATES = MAX_STEPS * MAX_WORKERS
"""Parameter-server shard updates: every worker's every step."""
MAX_LAYERS = 10_000
MAX_WIDTH = 2**16
"""model.n_embd, model.n_head and compression.rank."""
MAX_NUMEL = 2**40
"""Elements counted in one bucket or tensor."""
MAX_BUCKET_MB = 2**20
MAX_EVAL_SAMPLES = 10**7
MAX_VIRTUAL_STAGES = 1000
MAX_CHECKPOINTS_KEPT = 10**6
MAX_RESTARTS = 10**6
MAX_CPUS_PER_WORKER = 1024
MAX_SLOW_FACTOR = 1000
MAX_START_TIMEOUT_S = 10**7
MAX_STEP_DELAY_S = 60


# ---- validation -----------------------------------------------------------------


def validate(cfg: JobConfig) -> None:
    """Raise ConfigError for out-of-range values and inconsistent combinations."""
    _validate_name(cfg.name)
    _validate_model(cfg.model)
    _validate_task(cfg)
    _validate_data(cfg.data)
    _validate_train(cfg.train)
    _validate_optim(cfg.optim)
    _validate_strategy(cfg)
    validate_mesh(cfg)
    _validate_pipeline(cfg)
    _validate_parameter_server(cfg)
    _validate_compression(cfg)
    _validate_scaling(cfg.scaling)
    _validate_checkpoint(cfg.checkpoint)
    _validate_faults(cfg)
    max_failures = cfg.failure.max_failures
    _require("failure.max_failures", max_failures >= -1, max_failures, ">= -1 (-1: unlimited)")
    _cap("failure.max_failures", max_failures, MAX_RESTARTS, why=" (-1: unlimited)")
    _check_choice("tracking.backend", cfg.tracking.backend, TRACKING_BACKENDS)
    _validate_log(cfg)
    _check_choice("log.progress", cfg.log.progress, PROGRESS_MODES)
    _validate_cross_section(cfg)


def _validate_log(cfg: JobConfig) -> None:
    every, evals = cfg.log.every_steps, cfg.log.eval_every_steps
    _require("log.every_steps", every >= 1, every, ">= 1")
    _cap("log.every_steps", every, MAX_STEPS)
    _cap("log.eval_every_steps", evals, MAX_STEPS)
    allowed = f"0 (only at the end) or a multiple of log.every_steps={every}"
    _require("log.eval_every_steps", evals >= 0 and evals % every == 0, evals, allowed)


def _validate_name(name: str) -> None:
    if len(name) > NAME_MAX_CHARS or not NAME_PATTERN.fullmatch(name):
        raise ConfigError(
            f"name={show(name)} is not a valid run name; allowed: letters, digits, '.', '_' "
            f"and '-', starting with a letter or digit, at most {NAME_MAX_CHARS} characters"
        )


def _validate_model(m: ModelConfig) -> None:
    _check_choice("model.kind", m.kind, MODEL_KINDS)
    _require("model.n_layer", m.n_layer >= 1, m.n_layer, ">= 1")
    _cap("model.n_layer", m.n_layer, MAX_LAYERS)
    _require("model.n_head", m.n_head >= 1, m.n_head, ">= 1")
    _cap("model.n_head", m.n_head, MAX_WIDTH)
    _require("model.n_embd", m.n_embd >= 1, m.n_embd, ">= 1")
    _cap("model.n_embd", m.n_embd, MAX_WIDTH)
    _require(
        "model.block_size",
        2 <= m.block_size <= MAX_BLOCK_SIZE,
        m.block_size,
        f"2 to {MAX_BLOCK_SIZE}",
    )
    _require("model.dropout", 0 <= m.dropout < 1, m.dropout, "[0, 1)")
    _require("model.context", m.context >= 1, m.context, ">= 1")
    _cap("model.context", m.context, MAX_BLOCK_SIZE)
    _validate_model_source(m)
    if m.kind == "gpt" and m.n_embd % m.n_head:
        raise ConfigError(
            f"model.n_embd={m.n_embd} must be divisible by model.n_head={m.n_head}; "
            f"allowed: a multiple of {m.n_head}, e.g. {_next_multiple(m.n_embd, m.n_head)}"
        )


def _validate_model_source(m: ModelConfig) -> None:
    """The keys that name where a model comes from belong to one kind each."""
    for key, kind, value in (
        ("target", "custom", m.target),
        ("args", "custom", m.args),
        ("hf", "hf", m.hf),
        ("pretrained", "hf", m.pretrained),
    ):
        if value and m.kind != kind:
            raise ConfigError(
                f"model.{key} is set but model.kind={m.kind}; it needs model.kind={kind}"
            )
    if m.checkpoint_modules and m.kind in BUILTIN_MODEL_KINDS:
        raise ConfigError(
            f"model.checkpoint_modules applies to custom and hf models; model.kind={m.kind} "
            "checkpoints its own blocks (set model.activation_checkpointing=true)"
        )
    if m.kind == "custom":
        _check_import_path("model.target", m.target, what="your model class or factory")
    if m.kind == "hf" and not m.pretrained and "model_type" not in m.hf:
        raise ConfigError(
            "model.hf.model_type is missing; allowed: a Hugging Face model type such as "
            "llama or gpt2 (or set model.pretrained to a local save_pretrained directory)"
        )
    if m.kind == "hf" and "vocab_size" in m.hf:
        raise ConfigError(
            f"model.hf.vocab_size={show(m.hf['vocab_size'])} is set; the vocabulary follows "
            "data.vocab_size, so set that instead"
        )


def _check_import_path(key: str, value: str, *, what: str) -> None:
    if not IMPORT_PATH.fullmatch(value):
        raise ConfigError(
            f"{key}={show(value)} is not an import path; allowed: 'package.module:attribute' "
            f"naming {what}, e.g. 'my_pkg.models:build'"
        )


def _validate_task(cfg: JobConfig) -> None:
    t = cfg.task
    _check_choice("task.kind", t.kind, TASK_KINDS)
    if t.loss:
        _check_import_path("task.loss", t.loss, what="a function fn(outputs, batch) -> loss")
    wanted = DATA_TASKS.get(cfg.data.kind)
    if wanted is not None and wanted != t.kind:
        raise ConfigError(
            f"data.kind={cfg.data.kind} gives samples for task.kind={wanted}, not "
            f"task.kind={t.kind}; choose a {t.kind} data source or set task.kind={wanted}"
        )
    if t.kind == "classify" and cfg.model.kind not in ("custom",):
        raise ConfigError(
            f"task.kind=classify needs your own model (model.kind=custom); model.kind="
            f"{cfg.model.kind} is a language model (task.kind=lm)"
        )


def _validate_data(d: DataConfig) -> None:
    _check_choice("data.kind", d.kind, DATA_KINDS)
    _require(
        "data.num_classes", 2 <= d.num_classes <= MAX_CLASSES, d.num_classes, f"2 to {MAX_CLASSES}"
    )
    _require("data.noise", d.noise > 0, d.noise, "> 0")
    for i, size in enumerate(d.shape):
        _require(f"data.shape[{i}]", size >= 1, size, ">= 1")
    shape_ok = 1 <= len(d.shape) <= 4 and math.prod(d.shape) <= MAX_INPUT_NUMEL
    allowed_shape = f"1 to 4 sizes whose product is at most {MAX_INPUT_NUMEL}"
    _require("data.shape", shape_ok, list(d.shape), allowed_shape)
    _validate_data_files(d)
    if d.kind == "clusters" and d.num_classes * math.prod(d.shape) > MAX_TEMPLATE_NUMEL:
        raise ConfigError(
            f"data.num_classes × data.shape = {d.num_classes} × {list(d.shape)} gives "
            f"{d.num_classes * math.prod(d.shape)} template values, more than the "
            f"{MAX_TEMPLATE_NUMEL} (2**25) that fit; lower data.num_classes or data.shape"
        )
    _require(
        "data.vocab_size",
        2 <= d.vocab_size <= MAX_VOCAB_SIZE,
        d.vocab_size,
        f"2 to {MAX_VOCAB_SIZE}",
    )
    _require("data.order", 1 <= d.order <= MAX_MARKOV_ORDER, d.order, f"1 to {MAX_MARKOV_ORDER}")
    _require("data.concentration", d.concentration > 0, d.concentration, "> 0")
    _require("data.seed", 0 <= d.seed <= MAX_SEED, d.seed, f"0 to {MAX_SEED}")
    _require("data.eval_samples", d.eval_samples >= 0, d.eval_samples, ">= 0")
    _cap("data.eval_samples", d.eval_samples, MAX_EVAL_SAMPLES)
    states = d.vocab_size**d.order
    if d.kind == "markov" and states > MAX_MARKOV_STATES:
        raise ConfigError(
            f"data.vocab_size={d.vocab_size} with data.order={d.order} gives {states} Markov "
            f"states (vocab_size**order), more than the {MAX_MARKOV_STATES} (2**20) that fit; "
            "lower data.vocab_size or data.order"
        )


FILE_SOURCES: tuple[str, ...] = tuple(k.name for k in DATA_KIND_TABLE.values() if k.files)
"""Sources that read the user's files, named by `data.train` / `data.val`."""


def _validate_data_files(d: DataConfig) -> None:
    """Where the user's data comes from; whether the files exist is pre-flight's to say."""
    _require("data.val_fraction", 0 <= d.val_fraction < 0.5, d.val_fraction, "[0, 0.5)")
    _check_choice("data.token_dtype", d.token_dtype, TOKEN_DTYPES)
    _check_choice("data.format", d.format, RAY_FORMATS)
    from_files = d.kind in FILE_SOURCES and not (d.kind == "ray" and d.target)
    if from_files and not d.train:
        raise ConfigError(
            f"data.train is empty; data.kind={d.kind} reads your files: set data.train to "
            "paths or globs, e.g. data.train=[corpus/*.bin]"
        )
    if d.kind == "custom" or (d.kind == "ray" and d.target):
        what = "a map-style torch Dataset" if d.kind == "custom" else "a ray.data.Dataset"
        _check_import_path("data.target", d.target, what=f"a function or class returning {what}")
    if d.val and d.val_fraction:
        raise ConfigError(
            f"data.val and data.val_fraction={d.val_fraction} are both set; hold out either "
            "files (data.val) or a share of data.train (data.val_fraction), not both"
        )
    for key, value in (("data.inputs_key", d.inputs_key), ("data.labels_key", d.labels_key)):
        if not value or "/" in value:
            raise ConfigError(f"{key}={show(value)} is not a key; allowed: a name without '/'")
    if d.inputs_key == d.labels_key:
        raise ConfigError(
            f"data.inputs_key and data.labels_key are both {show(d.inputs_key)}; they must differ"
        )
    indexed = ("tokens", "text", "arrays", "custom")
    if d.kind in indexed and d.eval_samples and not (d.val or d.val_fraction):
        raise ConfigError(
            f"data.eval_samples={d.eval_samples} needs held-out data: set data.val (files) or "
            "data.val_fraction (a share of data.train), or data.eval_samples=0"
        )
    if d.kind == "text" and d.tokenizer != "bytes" and not d.tokenizer.endswith(".json"):
        raise ConfigError(
            f"data.tokenizer={show(d.tokenizer)} is not a tokenizer; allowed: bytes, or the "
            "path of a Hugging Face tokenizers JSON file (tokenizer.json)"
        )
    if d.kind == "text" and d.tokenizer == "bytes" and d.vocab_size != 256:
        raise ConfigError(
            f"data.vocab_size={d.vocab_size} does not match data.tokenizer=bytes; set "
            "data.vocab_size=256 (one token per byte)"
        )


def _validate_train(t: TrainConfig) -> None:
    _require("train.steps", t.steps >= 1, t.steps, ">= 1")
    _cap("train.steps", t.steps, MAX_STEPS)
    _require("train.global_batch_size", t.global_batch_size >= 1, t.global_batch_size, ">= 1")
    _cap("train.global_batch_size", t.global_batch_size, MAX_BATCH_SIZE)
    _require("train.micro_batch_size", t.micro_batch_size >= 1, t.micro_batch_size, ">= 1")
    _cap("train.micro_batch_size", t.micro_batch_size, MAX_BATCH_SIZE)
    _require("train.seed", 0 <= t.seed <= MAX_SEED, t.seed, f"0 to {MAX_SEED}")
    _check_choice("train.precision", t.precision, PRECISIONS)


def _validate_optim(o: OptimConfig) -> None:
    _check_choice("optim.kind", o.kind, OPTIM_KINDS)
    _require("optim.lr", o.lr > 0, o.lr, "> 0")
    _require("optim.weight_decay", o.weight_decay >= 0, o.weight_decay, ">= 0")
    for i, beta in enumerate(o.betas):
        _require(f"optim.betas[{i}]", 0 <= beta < 1, beta, "[0, 1)")
    _require("optim.momentum", 0 <= o.momentum < 1, o.momentum, "[0, 1)")
    _require("optim.warmup_steps", o.warmup_steps >= 0, o.warmup_steps, ">= 0")
    _check_choice("optim.schedule", o.schedule, LR_SCHEDULES)
    _require("optim.min_lr_ratio", 0 <= o.min_lr_ratio <= 1, o.min_lr_ratio, "[0, 1]")
    _require("optim.grad_clip", o.grad_clip >= 0, o.grad_clip, ">= 0 (0 disables clipping)")
    _check_choice("optim.lr_scaling", o.lr_scaling, LR_SCALINGS)


def _validate_strategy(cfg: JobConfig) -> None:
    s = cfg.strategy
    _check_choice("strategy.kind", s.kind, STRATEGY_KINDS)
    _require("strategy.bucket_cap_mb", s.bucket_cap_mb > 0, s.bucket_cap_mb, "> 0")
    _cap("strategy.bucket_cap_mb", s.bucket_cap_mb, MAX_BUCKET_MB)
    _require("strategy.stage", 1 <= s.stage <= 3, s.stage, "1, 2 or 3")
    _check_choice("strategy.offload_optimizer", s.offload_optimizer, OFFLOAD_DEVICES)
    _check_choice("strategy.offload_param", s.offload_param, OFFLOAD_DEVICES)
    _require("strategy.reduce_bucket_size", s.reduce_bucket_size > 0, s.reduce_bucket_size, "> 0")
    _cap("strategy.reduce_bucket_size", s.reduce_bucket_size, MAX_NUMEL)
    if s.offload_param != "none" and s.kind != "fsdp" and s.stage != 3:
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
        deepspeed_pipeline = s.kind == "pipeline" and s.engine == "deepspeed"
        _validate_deepspeed(cfg.deepspeed, kind=s.kind, derives_zero=not deepspeed_pipeline)


def _validate_pipeline(cfg: JobConfig) -> None:
    s, m = cfg.strategy, cfg.model
    _check_choice("strategy.schedule", s.schedule, PIPELINE_SCHEDULES)
    _check_choice("strategy.engine", s.engine, PIPELINE_ENGINES)
    _require("strategy.stages", s.stages >= 2, s.stages, ">= 2 (one stage: use ddp)")
    _cap("strategy.stages", s.stages, MAX_WORKERS)
    _require("strategy.microbatches", s.microbatches >= 1, s.microbatches, ">= 1")
    _cap("strategy.microbatches", s.microbatches, MAX_BATCH_SIZE)
    _require("strategy.virtual_stages", s.virtual_stages >= 0, s.virtual_stages, ">= 0")
    _cap("strategy.virtual_stages", s.virtual_stages, MAX_VIRTUAL_STAGES)
    _require("strategy.data_parallel", s.data_parallel >= 1, s.data_parallel, ">= 1")
    _cap("strategy.data_parallel", s.data_parallel, MAX_WORKERS)
    if s.kind != "pipeline":
        return
    p, d, v = s.stages, s.data_parallel, cfg.pipeline_virtual_stages
    if m.kind == "mlp":
        raise ConfigError(
            "strategy.kind=pipeline cuts a model into its pipeline layers; model.kind=mlp has "
            "none (use gpt, hf, or a custom model with pipeline_layers())"
        )
    t = s.tensor_parallel
    if cfg.scaling.num_workers != p * d * t:
        raise ConfigError(
            f"scaling.num_workers={cfg.scaling.num_workers} must equal strategy.stages × "
            f"strategy.data_parallel × strategy.tensor_parallel = {p} × {d} × {t} = {p * d * t}"
        )
    if s.engine == "deepspeed":
        _validate_deepspeed_pipeline(cfg)
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
    if m.kind == "gpt" and p * v > m.n_layer:
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
    _validate_pipeline_batch(cfg)


def _validate_parameter_server(cfg: JobConfig) -> None:
    s = cfg.strategy
    _check_choice("strategy.consistency", s.consistency, PS_CONSISTENCY)
    _check_choice("strategy.staleness_lr", s.staleness_lr, PS_STALENESS_LR)
    _require("strategy.num_shards", s.num_shards >= 1, s.num_shards, ">= 1")
    _cap("strategy.num_shards", s.num_shards, MAX_WORKERS)
    _require("strategy.staleness_bound", s.staleness_bound >= 0, s.staleness_bound, ">= 0")
    _cap("strategy.staleness_bound", s.staleness_bound, MAX_UPDATES)
    _require("strategy.staleness_alpha", s.staleness_alpha >= 0, s.staleness_alpha, ">= 0")
    _require("strategy.pull_every", s.pull_every >= 1, s.pull_every, ">= 1")
    _cap("strategy.pull_every", s.pull_every, MAX_STEPS)
    _require(
        "strategy.checkpoint_every_updates",
        s.checkpoint_every_updates >= 1,
        s.checkpoint_every_updates,
        ">= 1",
    )
    _cap("strategy.checkpoint_every_updates", s.checkpoint_every_updates, MAX_UPDATES)
    auto = "-1 (auto: 0 on one machine, 1 on a multi-node cluster) or >= 0"
    _require("strategy.ps_cpus", s.ps_cpus == -1 or s.ps_cpus >= 0, s.ps_cpus, auto)
    _cap("strategy.ps_cpus", s.ps_cpus, MAX_CPUS_PER_WORKER)
    f = cfg.faults
    _require("faults.slow_factor", f.slow_factor >= 1, f.slow_factor, ">= 1")
    _cap("faults.slow_factor", f.slow_factor, MAX_SLOW_FACTOR)
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
    _require("faults.slow_rank", -1 <= f.slow_rank < workers, f.slow_rank, f"-1 to {workers - 1}")
    _require("faults.shard", 0 <= f.shard < s.num_shards, f.shard, f"0 to {s.num_shards - 1}")


def _validate_deepspeed_pipeline(cfg: JobConfig) -> None:
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
    if m.kind == "gpt" and s.stages > m.n_layer:
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
    _validate_pipeline_batch(cfg)


def _validate_pipeline_batch(cfg: JobConfig) -> None:
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


def _validate_deepspeed(raw: dict[str, Any], *, kind: str, derives_zero: bool) -> None:
    """`deepspeed:` is for DeepSpeed keys trainstack does not derive, under ZeRO or the
    DeepSpeed pipeline engine (which takes `zero_optimization` from it)."""
    if derives_zero and kind != "zero":
        raise ConfigError(
            "deepspeed: raw DeepSpeed keys apply only with strategy.kind=zero or "
            f"strategy.engine=deepspeed; got strategy.kind={kind}"
        )
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


def _validate_compression(cfg: JobConfig) -> None:
    c = cfg.compression
    _check_choice("compression.kind", c.kind, COMPRESSION_KINDS)
    _require("compression.ratio", 0 < c.ratio <= 1, c.ratio, "(0, 1]")
    bits_allowed = ", ".join(str(b) for b in QSGD_BITS)
    _require("compression.bits", c.bits in QSGD_BITS, c.bits, bits_allowed)
    _require("compression.rank", c.rank >= 1, c.rank, ">= 1")
    _cap("compression.rank", c.rank, MAX_WIDTH)
    _require("compression.min_numel", c.min_numel >= 0, c.min_numel, ">= 0")
    _cap("compression.min_numel", c.min_numel, MAX_NUMEL)
    _require(
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
    _require(
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


def _validate_scaling(s: ScalingConfig) -> None:
    _require("scaling.num_workers", s.num_workers >= 1, s.num_workers, ">= 1")
    if s.device_memory:
        parse_quantity("scaling.device_memory", s.device_memory, units=True, example="80GB")
    _cap("scaling.num_workers", s.num_workers, MAX_WORKERS)
    _require("scaling.cpus_per_worker", s.cpus_per_worker > 0, s.cpus_per_worker, "> 0")
    _cap("scaling.cpus_per_worker", s.cpus_per_worker, MAX_CPUS_PER_WORKER)
    timeout = s.start_timeout_s
    _require("scaling.start_timeout_s", timeout >= 0, timeout, ">= 0 (0: wait forever)")
    _cap("scaling.start_timeout_s", timeout, MAX_START_TIMEOUT_S, why=" (0: wait forever)")
    fewest = f"0 (a fixed group) to scaling.num_workers={s.num_workers}"
    _require("scaling.min_workers", 0 <= s.min_workers <= s.num_workers, s.min_workers, fewest)
    _require("scaling.resize_check_s", s.resize_check_s > 0, s.resize_check_s, "> 0")
    _cap("scaling.resize_check_s", s.resize_check_s, MAX_START_TIMEOUT_S)
    for name, amount in s.resources_per_worker.items():
        key = f"scaling.resources_per_worker.{name}"
        if name in RAY_BUILTIN_RESOURCES:
            raise ConfigError(
                f"{key}: CPUs and GPUs are set by scaling.cpus_per_worker and scaling.use_gpu; "
                "allowed here: custom resources the cluster's nodes advertise"
            )
        if isinstance(amount, bool) or not isinstance(amount, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {show(amount)}")
        _require(key, amount > 0, float(amount), "> 0")
        _cap(key, amount, MAX_CPUS_PER_WORKER)


RAY_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")


def _validate_elastic(cfg: JobConfig) -> None:
    """An elastic group (`scaling.min_workers` > 0) keeps the global batch at every size."""
    s, g = cfg.scaling, cfg.train.global_batch_size
    if not s.elastic:
        return
    sizes = f"{{min: {s.min_workers}, max: {s.num_workers}}}"
    if cfg.strategy.kind not in ("ddp", "zero"):
        raise ConfigError(
            f"scaling.num_workers={sizes} with strategy.kind={cfg.strategy.kind}: elastic "
            "scaling is for strategy.kind ddp or zero (a pipeline could resize only by whole "
            "replicas; a parameter server keeps its workers); give num_workers a number"
        )
    if cfg.data.kind == "ray":
        raise ConfigError(
            f"scaling.num_workers={sizes} with data.kind=ray: Ray Data's shards are fixed per "
            "group; elastic scaling needs an indexed source (markov, tokens, text, arrays, ...)"
        )
    misfits = [n for n in range(s.min_workers, s.num_workers + 1) if g % n]
    if misfits:
        every = math.lcm(*range(s.min_workers, s.num_workers + 1))
        raise ConfigError(
            f"train.global_batch_size={g} must be divisible by every worker count of "
            f"scaling.num_workers={sizes} (the global batch stays fixed as the group resizes); "
            f"{misfits[0]} does not divide it; allowed: a multiple of {every}, "
            f"e.g. {_next_multiple(g, every)}"
        )


def _validate_checkpoint(c: CheckpointConfig) -> None:
    _require(
        "checkpoint.every_steps", c.every_steps >= 0, c.every_steps, ">= 0 (0: only at the end)"
    )
    _cap("checkpoint.every_steps", c.every_steps, MAX_STEPS)
    _require("checkpoint.keep", c.keep >= 1, c.keep, ">= 1")
    _cap("checkpoint.keep", c.keep, MAX_CHECKPOINTS_KEPT)
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
    _check_choice("checkpoint.on_corrupt", c.on_corrupt, CORRUPT_CHECKPOINT_ACTIONS)


def _validate_object_store(cfg: JobConfig) -> None:
    """What cannot keep its files in an object store yet."""
    kind = kind_of(cfg)
    if not kind.object_store_checkpoints and is_store_uri(cfg.checkpoint.storage_path):
        raise ConfigError(
            f"checkpoint.storage_path={show(cfg.checkpoint.storage_path)}: strategy.kind="
            f"{kind.name} keeps its shard checkpoints in a shared filesystem, not an object store; "
            "allowed: a path every node mounts (e.g. NFS), or strategy.kind "
            f"{kinds_that(lambda k: k.object_store_checkpoints and k.runs_on == 'ray_train')}"
        )


def _validate_faults(cfg: JobConfig) -> None:
    f, steps, workers = cfg.faults, cfg.train.steps, cfg.scaling.num_workers
    for i, step in enumerate(f.kill_at_steps):
        _require(f"faults.kill_at_steps[{i}]", 1 <= step <= steps, step, f"1 to {steps}")
    _require(
        "faults.random_kills", 0 <= f.random_kills < steps, f.random_kills, f"0 to {steps - 1}"
    )
    _require("faults.rank", -1 <= f.rank < workers, f.rank, f"-1 (random) to {workers - 1}")
    for i, update in enumerate(f.kill_shard_at_updates):
        where = f"faults.kill_shard_at_updates[{i}]"
        _require(where, 1 <= update <= MAX_UPDATES, update, f"1 to {MAX_UPDATES:,}")
    _require("faults.seed", 0 <= f.seed <= MAX_SEED, f.seed, f"0 to {MAX_SEED}")
    _cap("faults.shard", f.shard, MAX_WORKERS)  # ps: checked against its shards too
    _cap("faults.slow_rank", f.slow_rank, MAX_WORKERS)
    delay = f.step_delay_s
    _require(
        "faults.step_delay_s", 0 <= delay <= MAX_STEP_DELAY_S, delay, f"0 to {MAX_STEP_DELAY_S}"
    )


def _validate_streaming(cfg: JobConfig) -> None:
    """`data.kind: ray` streams rows through Ray Train's dataset shards, G / N per worker."""
    d, workers = cfg.data, cfg.scaling.num_workers
    if d.kind != "ray":
        return
    if kind_of(cfg).runs_on == "actors":
        raise ConfigError(
            "data.kind=ray streams through Ray Train's dataset shards, which the parameter "
            "server does not use; allowed with strategy.kind "
            f"{kinds_that(lambda k: k.runs_on == 'ray_train')}"
        )
    if d.val_fraction:
        raise ConfigError(
            f"data.val_fraction={d.val_fraction} is not supported with data.kind=ray (a stream "
            "has no known size); name held-out files in data.val"
        )
    if cfg.train.global_batch_size % workers:
        raise ConfigError(
            f"train.global_batch_size={cfg.train.global_batch_size} must be divisible by "
            f"scaling.num_workers={workers} with data.kind=ray (each worker reads G / N rows)"
        )


def _validate_cross_section(cfg: JobConfig) -> None:
    _validate_streaming(cfg)
    _validate_fp64(cfg)
    _validate_object_store(cfg)
    _validate_elastic(cfg)
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
            f"e.g. {_next_multiple(t.global_batch_size, per_step)}"
        )
    if o.warmup_steps >= t.steps:
        raise ConfigError(
            f"optim.warmup_steps={o.warmup_steps} must be less than train.steps={t.steps}; "
            f"allowed: 0 to {t.steps - 1}"
        )


def _validate_fp64(cfg: JobConfig) -> None:
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


def _require(key: str, ok: bool, value: object, allowed: str) -> None:
    """Raise unless `ok`; a non-finite float never passes a range check."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}={show(value)} is not a finite number; allowed: {allowed}")
    if not ok:
        raise ConfigError(f"{key}={show(value)} is out of range; allowed: {allowed}")


def _cap(key: str, value: float, most: int, *, why: str = "") -> None:
    """Raise when a count is past `most`, the ceiling of what can run."""
    if value > most:
        raise ConfigError(
            f"{key}={_show_number(value)} is out of range; allowed: at most {most:,}{why}"
        )


def _show_number(value: float) -> str:
    """`value` for a message; a huge one (a YAML `1e30` read as an integer) as `1e+30`."""
    if abs(value) < 10**15:
        return show(value)
    try:
        return f"{float(value):.3g}"
    except OverflowError:
        return "a number past 1e308"


def _check_choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value in allowed:
        return
    close = difflib.get_close_matches(value, allowed, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ConfigError(f"{key}={show(value)} is not one of {', '.join(allowed)}{hint}")


def _next_multiple(value: int, step: int) -> int:
    return -(-value // step) * step
