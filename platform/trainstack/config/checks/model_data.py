"""Checks of the model, task and data sections."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from trainstack.config.checks.allowed import (
    BUILTIN_MODEL_KINDS,
    DATA_KINDS,
    DATA_TASKS,
    IMPORT_PATH,
    MAX_BLOCK_SIZE,
    MAX_CLASSES,
    MAX_EVAL_SAMPLES,
    MAX_INPUT_NUMEL,
    MAX_LAYERS,
    MAX_MARKOV_ORDER,
    MAX_MARKOV_STATES,
    MAX_SEED,
    MAX_TEMPLATE_NUMEL,
    MAX_VOCAB_SIZE,
    MAX_WIDTH,
    MODEL_KINDS,
    RAY_FORMATS,
    TASK_KINDS,
    TOKEN_DTYPES,
)
from trainstack.config.checks.common import cap, check_choice, next_multiple, require
from trainstack.errors import ConfigError, show
from trainstack.kinds import DATA_KINDS as DATA_KIND_TABLE
from trainstack.kinds import MODEL_KINDS as MODEL_KIND_TABLE
from trainstack.kinds import kind_of, kinds_that, load, model_kind_of

if TYPE_CHECKING:
    from trainstack.config.sections import (
        DataConfig,
        JobConfig,
        ModelConfig,
    )


def validate_model(m: ModelConfig) -> None:
    check_choice("model.kind", m.kind, MODEL_KINDS)
    require("model.n_layer", m.n_layer >= 1, m.n_layer, ">= 1")
    cap("model.n_layer", m.n_layer, MAX_LAYERS)
    require("model.n_head", m.n_head >= 1, m.n_head, ">= 1")
    cap("model.n_head", m.n_head, MAX_WIDTH)
    require("model.n_embd", m.n_embd >= 1, m.n_embd, ">= 1")
    cap("model.n_embd", m.n_embd, MAX_WIDTH)
    require(
        "model.block_size",
        2 <= m.block_size <= MAX_BLOCK_SIZE,
        m.block_size,
        f"2 to {MAX_BLOCK_SIZE}",
    )
    require("model.dropout", 0 <= m.dropout < 1, m.dropout, "[0, 1)")
    require("model.context", m.context >= 1, m.context, ">= 1")
    cap("model.context", m.context, MAX_BLOCK_SIZE)
    validate_model_source(m)
    kind = MODEL_KIND_TABLE[m.kind]
    if kind.spec_check:
        load(kind.spec_check)(m)


def validate_model_source(m: ModelConfig) -> None:
    """The keys that name where a model comes from belong to one kind each."""
    for owner in MODEL_KIND_TABLE.values():
        for key in owner.own_keys:
            if getattr(m, key) and m.kind != owner.name:
                raise ConfigError(
                    f"model.{key} is set but model.kind={m.kind}; it needs model.kind={owner.name}"
                )
    if m.checkpoint_modules and m.kind in BUILTIN_MODEL_KINDS:
        raise ConfigError(
            f"model.checkpoint_modules applies to custom and hf models; model.kind={m.kind} "
            "checkpoints its own blocks (set model.activation_checkpointing=true)"
        )


# ---- each model kind's own (`ModelKind.spec_check`) ------------------------------


def check_gpt(m: ModelConfig) -> None:
    if m.n_embd % m.n_head:
        raise ConfigError(
            f"model.n_embd={m.n_embd} must be divisible by model.n_head={m.n_head}; "
            f"allowed: a multiple of {m.n_head}, e.g. {next_multiple(m.n_embd, m.n_head)}"
        )


def check_custom_model(m: ModelConfig) -> None:
    check_import_path("model.target", m.target, what="your model class or factory")


def check_hf(m: ModelConfig) -> None:
    if not m.pretrained and "model_type" not in m.hf:
        raise ConfigError(
            "model.hf.model_type is missing; allowed: a Hugging Face model type such as "
            "llama or gpt2 (or set model.pretrained to a local save_pretrained directory)"
        )
    if "vocab_size" in m.hf:
        raise ConfigError(
            f"model.hf.vocab_size={show(m.hf['vocab_size'])} is set; the vocabulary follows "
            "data.vocab_size, so set that instead"
        )


def check_import_path(key: str, value: str, *, what: str) -> None:
    if not IMPORT_PATH.fullmatch(value):
        raise ConfigError(
            f"{key}={show(value)} is not an import path; allowed: 'package.module:attribute' "
            f"naming {what}, e.g. 'my_pkg.models:build'"
        )


def validate_fused_loss(cfg: JobConfig) -> None:
    """`model.fused_loss` needs the whole model's forward to see the targets."""
    if not cfg.model.fused_loss:
        return
    m, s = cfg.model, cfg.strategy
    why = None
    if not model_kind_of(cfg).fused_loss:
        allowed = kinds_that(lambda k: k.fused_loss, table=MODEL_KIND_TABLE)
        why = f"is for model.kind {allowed}; got {m.kind}"
    elif cfg.task.kind != "lm" or cfg.task.loss:
        why = (
            "computes the lm task's cross-entropy; it cannot take task.kind classify or dpo, "
            "or task.loss"
        )
    elif kind_of(cfg).ranks == "pipeline":
        why = "needs the targets at the head, which a pipeline's last stage does not pass in"
    elif s.tensor_parallel > 1:
        why = "is what strategy.loss_parallel already does under tensor parallelism"
    if why:
        raise ConfigError(f"model.fused_loss=true {why}; set model.fused_loss=false")


def validate_pack(cfg: JobConfig) -> None:
    """`data.pack` hands the model position ids beside the tokens, which a Hugging Face
    family's own forward takes, and so do its pipeline layers (llama, gpt2, and every
    family under a pipeline: they pass them from stage to stage and give each decoder
    layer its packed-sequence mask). DeepSpeed's pipeline engine is not given them.
    trainstack's GPT takes them in its own forward (each token attends within its
    document), and under context parallelism its ring does."""
    if not cfg.data.pack:
        return
    why = None
    if cfg.data.kind not in ("chat", "preference"):
        why = f"packs conversations: it is for data.kind chat or preference; got {cfg.data.kind}"
    elif cfg.model.kind not in ("hf", "gpt"):
        why = f"gives the model position ids: it is for model.kind hf or gpt; got {cfg.model.kind}"
    elif cfg.model.kind == "gpt" and (
        cfg.model.activation_checkpointing
        or kind_of(cfg).ranks == "pipeline"
        or cfg.strategy.tensor_parallel > 1
    ):
        why = (
            "gives trainstack's GPT documents to keep apart in its forward, which "
            "activation checkpointing's recompute, a pipeline's stages and tensor "
            "parallelism's position split do not carry yet; allowed: model.kind gpt under "
            "ddp, zero or fsdp (context parallel too) without them"
        )
    elif kind_of(cfg).ranks == "pipeline" and cfg.strategy.engine != "torch":
        why = (
            "hands the pipeline's stages position ids, which only the torch engine passes "
            f"on; got strategy.engine={cfg.strategy.engine}, allowed: torch"
        )
    if why:
        raise ConfigError(f"data.pack=true {why}; or set data.pack=false")


def validate_task(cfg: JobConfig) -> None:
    t = cfg.task
    check_choice("task.kind", t.kind, TASK_KINDS)
    if t.loss:
        check_import_path("task.loss", t.loss, what="a function fn(outputs, batch) -> loss")
    wanted = DATA_TASKS.get(cfg.data.kind)
    if wanted is not None and wanted != t.kind:
        raise ConfigError(
            f"data.kind={cfg.data.kind} gives samples for task.kind={wanted}, not "
            f"task.kind={t.kind}; choose a {t.kind} data source or set task.kind={wanted}"
        )
    if t.kind not in MODEL_KIND_TABLE[cfg.model.kind].tasks:
        takes = kinds_that(lambda k: t.kind in k.tasks, table=MODEL_KIND_TABLE, last=" or ")
        raise ConfigError(
            f"task.kind={t.kind} needs your own model (model.kind={takes}); model.kind="
            f"{cfg.model.kind} is a language model (task.kind=lm)"
        )


def validate_data(d: DataConfig) -> None:
    check_choice("data.kind", d.kind, DATA_KINDS)
    require(
        "data.num_classes", 2 <= d.num_classes <= MAX_CLASSES, d.num_classes, f"2 to {MAX_CLASSES}"
    )
    require("data.noise", d.noise > 0, d.noise, "> 0")
    for i, size in enumerate(d.shape):
        require(f"data.shape[{i}]", size >= 1, size, ">= 1")
    shape_ok = 1 <= len(d.shape) <= 4 and math.prod(d.shape) <= MAX_INPUT_NUMEL
    allowed_shape = f"1 to 4 sizes whose product is at most {MAX_INPUT_NUMEL}"
    require("data.shape", shape_ok, list(d.shape), allowed_shape)
    validate_data_files(d)
    require(
        "data.vocab_size",
        2 <= d.vocab_size <= MAX_VOCAB_SIZE,
        d.vocab_size,
        f"2 to {MAX_VOCAB_SIZE}",
    )
    require("data.order", 1 <= d.order <= MAX_MARKOV_ORDER, d.order, f"1 to {MAX_MARKOV_ORDER}")
    require("data.concentration", d.concentration > 0, d.concentration, "> 0")
    require("data.seed", 0 <= d.seed <= MAX_SEED, d.seed, f"0 to {MAX_SEED}")
    require("data.eval_samples", d.eval_samples >= 0, d.eval_samples, ">= 0")
    cap("data.eval_samples", d.eval_samples, MAX_EVAL_SAMPLES)
    kind = DATA_KIND_TABLE[d.kind]
    if kind.spec_check:
        load(kind.spec_check)(d)


def validate_data_files(d: DataConfig) -> None:
    """Where the user's data comes from; whether the files exist is pre-flight's to say."""
    require("data.val_fraction", 0 <= d.val_fraction < 0.5, d.val_fraction, "[0, 0.5)")
    check_choice("data.token_dtype", d.token_dtype, TOKEN_DTYPES)
    check_choice("data.format", d.format, RAY_FORMATS)
    kind = DATA_KIND_TABLE[d.kind]
    if kind.reads_files(d.target) and not d.train:
        raise ConfigError(
            f"data.train is empty; data.kind={d.kind} reads your files: set data.train to "
            "paths or globs, e.g. data.train=[corpus/*.bin]"
        )
    if kind.from_factory(d.target):
        what = f"a function or class returning {kind.factory}"
        check_import_path("data.target", d.target, what=what)
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
    indexed = not kind.generated and not kind.streams  # held out: files or a split
    if indexed and d.eval_samples and not (d.val or d.val_fraction):
        raise ConfigError(
            f"data.eval_samples={d.eval_samples} needs held-out data: set data.val (files) or "
            "data.val_fraction (a share of data.train), or data.eval_samples=0"
        )


# ---- each data kind's own (`DataKind.spec_check`) --------------------------------


def check_markov(d: DataConfig) -> None:
    states = d.vocab_size**d.order
    if states > MAX_MARKOV_STATES:
        raise ConfigError(
            f"data.vocab_size={d.vocab_size} with data.order={d.order} gives {states} Markov "
            f"states (vocab_size**order), more than the {MAX_MARKOV_STATES} (2**20) that fit; "
            "lower data.vocab_size or data.order"
        )


def check_clusters(d: DataConfig) -> None:
    if d.num_classes * math.prod(d.shape) > MAX_TEMPLATE_NUMEL:
        raise ConfigError(
            f"data.num_classes × data.shape = {d.num_classes} × {list(d.shape)} gives "
            f"{d.num_classes * math.prod(d.shape)} template values, more than the "
            f"{MAX_TEMPLATE_NUMEL} (2**25) that fit; lower data.num_classes or data.shape"
        )


def check_text(d: DataConfig) -> None:
    if d.tokenizer != "bytes" and not d.tokenizer.endswith(".json"):
        raise ConfigError(
            f"data.tokenizer={show(d.tokenizer)} is not a tokenizer; allowed: bytes, or the "
            "path of a Hugging Face tokenizers JSON file (tokenizer.json)"
        )
    if d.tokenizer == "bytes" and d.vocab_size != 256:
        raise ConfigError(
            f"data.vocab_size={d.vocab_size} does not match data.tokenizer=bytes; set "
            "data.vocab_size=256 (one token per byte)"
        )


def validate_streaming(cfg: JobConfig) -> None:
    """`data.kind: ray` streams rows through Ray Train's dataset shards, G / N per worker."""
    d, workers = cfg.data, cfg.scaling.num_workers
    if not DATA_KIND_TABLE[d.kind].streams:
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
