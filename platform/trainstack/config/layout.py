"""Checks of a `strategy.kind: fsdp` layout: the mesh `[dp_replicate, dp_shard, tp]`
must tile the workers, and tensor parallelism must divide the model it cuts.

Pure Python, run with the rest of the spec's validation (`config.checks.validate`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainstack.errors import ConfigError
from trainstack.kinds import MODEL_KINDS, data_kind_of, kind_of, kinds_that, model_kind_of

if TYPE_CHECKING:
    from trainstack.config.sections import JobConfig

TENSOR_PARALLEL_MODELS: tuple[str, ...] = tuple(
    k.name for k in MODEL_KINDS.values() if k.tensor_parallel
)
"""Model kinds with a tensor-parallel plan (`strategies/tensor_parallel.py`; hf: the
family's `base_model_tp_plan`, its styles and sizes checked in pre-flight on the built
model)."""
MAX_DEGREE = 4096
CONTEXT_PARALLEL_FAMILIES = ("llama", "qwen2", "qwen3")
"""Hugging Face families whose every layer attends causally over the whole row (no
sliding window) through transformers' attention functions, which context parallelism
replaces by its ring (`strategies/context_parallel.py`)."""


def validate_mesh(cfg: JobConfig) -> None:
    """Raise ConfigError for a mesh layout that cannot run."""
    s = cfg.strategy
    for key, value in (
        ("strategy.tensor_parallel", s.tensor_parallel),
        ("strategy.data_parallel_replicate", s.data_parallel_replicate),
        ("strategy.context_parallel", s.context_parallel),
    ):
        if not 1 <= value <= MAX_DEGREE:
            raise ConfigError(f"{key}={value} is out of range; allowed: 1 to {MAX_DEGREE}")
    ranks = kind_of(cfg).ranks
    if s.context_parallel != 1 and ranks != "mesh":
        raise ConfigError(
            f"strategy.context_parallel={s.context_parallel} splits every row's tokens over "
            f"fsdp's mesh; strategy.kind={s.kind} does not lay one (allowed: strategy.kind "
            "fsdp, or context_parallel=1)"
        )
    if ranks == "pipeline":
        _validate_pipeline_mesh(cfg)
        return
    if s.shard_replicas:
        raise ConfigError(
            f"strategy.shard_replicas=true is for strategy.kind=pipeline; with "
            f"strategy.kind={s.kind} use strategy.kind=fsdp (or zero) to shard replicas"
        )
    if ranks != "mesh":
        if s.tensor_parallel != 1 or s.data_parallel_replicate != 1:
            raise ConfigError(
                f"strategy.tensor_parallel={s.tensor_parallel} and "
                f"strategy.data_parallel_replicate={s.data_parallel_replicate} lay out a device "
                f"mesh, which strategy.kind={s.kind} does not use; set strategy.kind=fsdp, or "
                "leave both at 1"
            )
        return
    _validate_tiling(cfg)
    _validate_tensor_parallel(cfg)
    _validate_context_parallel(cfg)
    _validate_companions(cfg)


def _validate_pipeline_mesh(cfg: JobConfig) -> None:
    """A pipeline's stages may be tensor-parallel (the torch engine, the GPT) and its
    replicas sharded (the torch engine), in groups that replicate each other (HSDP)."""
    s = cfg.strategy
    r = s.data_parallel_replicate
    if r != 1 and not s.shard_replicas:
        raise ConfigError(
            f"strategy.data_parallel_replicate={r} groups a pipeline's sharded replicas "
            "(HSDP); it needs strategy.shard_replicas=true, or leave it at 1"
        )
    if s.data_parallel % r:
        raise ConfigError(
            f"strategy.data_parallel={s.data_parallel} must be a multiple of "
            f"strategy.data_parallel_replicate={r}: the replicas form {r} groups that each "
            "shard the stages alike"
        )
    if s.shard_replicas and s.engine != "torch":
        raise ConfigError(
            "strategy.shard_replicas=true shards a pipeline's replicas with FSDP2, which "
            f"needs strategy.engine=torch (got {s.engine}; DeepSpeed's engine has its own "
            "ZeRO stage 1 in deepspeed.zero_optimization)"
        )
    if s.tensor_parallel == 1:
        return
    if cfg.train.compile and cfg.model.activation_checkpointing:
        raise ConfigError(
            "train.compile=true with model.activation_checkpointing=true and "
            f"strategy.tensor_parallel={s.tensor_parallel} inside a pipeline fails in "
            "torch.compile (its saved tensors include a device mesh); drop one of the three"
        )
    if s.engine != "torch" or not model_kind_of(cfg).shape_in_spec:
        shaped = kinds_that(lambda k: k.shape_in_spec, table=MODEL_KINDS, last=" or ")
        raise ConfigError(
            f"strategy.tensor_parallel={s.tensor_parallel} inside a pipeline needs "
            f"strategy.engine=torch and model.kind={shaped} (got {s.engine}, {cfg.model.kind})"
        )
    _validate_tensor_parallel(cfg)
    if data_kind_of(cfg).streams:
        raise ConfigError(
            f"data.kind={cfg.data.kind} with strategy.tensor_parallel={s.tensor_parallel}: "
            "tensor-parallel ranks must see the same rows; use an indexed source or "
            "tensor_parallel=1"
        )


def _validate_tiling(cfg: JobConfig) -> None:
    s, workers = cfg.strategy, cfg.scaling.num_workers
    r, c, t = s.data_parallel_replicate, s.context_parallel, s.tensor_parallel
    if workers % (r * c * t):
        raise ConfigError(
            f"scaling.num_workers={workers} must be a multiple of "
            f"strategy.data_parallel_replicate × strategy.context_parallel × "
            f"strategy.tensor_parallel = {r} × {c} × {t} = {r * c * t} (the mesh is replicate "
            "× shard × context-parallel × tensor-parallel, and the shard degree is what is "
            "left)"
        )


def _validate_context_parallel(cfg: JobConfig) -> None:
    """Context parallelism splits a GPT's rows for the `lm` task, its attention a ring
    (`strategies/context_parallel.py`); what it does not combine with yet is refused."""
    s, m, c = cfg.strategy, cfg.model, cfg.strategy.context_parallel
    if c == 1:
        return
    where = f"strategy.context_parallel={c}"
    families = CONTEXT_PARALLEL_FAMILIES
    family = m.hf.get("model_type") if isinstance(m.hf, dict) else None
    if not (m.kind == "gpt" or (m.kind == "hf" and family in families and not m.pretrained)):
        what = f"model.kind={m.kind}" + (f" (model_type {family})" if m.kind == "hf" else "")
        raise ConfigError(
            f"{where} runs attention as a ring over the ranks, for trainstack's GPT and the "
            f"Hugging Face families {', '.join(families)} (model.hf.model_type, not yet from "
            f"a pretrained folder); {what} is not one of them, or use context_parallel=1"
        )
    if m.block_size % (2 * c):
        raise ConfigError(
            f"{where}: model.block_size={m.block_size} must be divisible by 2 × {c} = "
            f"{2 * c} (each rank holds an early and a late chunk of every row)"
        )
    unsupported = {
        "strategy.data_parallel_replicate": s.data_parallel_replicate > 1,
        "model.dropout": m.dropout > 0,
        "model.moe": m.moe.experts > 0,
        "model.lora": m.lora.rank > 0,
        "model.fused_loss": m.fused_loss,
        "train.compile": cfg.train.compile,
        f"task.kind={cfg.task.kind}": cfg.task.kind != "lm",
        f"data.kind={cfg.data.kind}": data_kind_of(cfg).streams,
    }
    for key, on in unsupported.items():
        if on:
            raise ConfigError(
                f"{where} with {key} set: context parallelism does not combine with it yet; "
                "allowed: fsdp (sharded, tensor parallel too) with an indexed source, the lm "
                "task and a dense GPT without dropout, or context_parallel=1"
            )


def _validate_tensor_parallel(cfg: JobConfig) -> None:
    t, m = cfg.strategy.tensor_parallel, cfg.model
    if t == 1:
        return
    if m.kind not in TENSOR_PARALLEL_MODELS:
        raise ConfigError(
            f"strategy.tensor_parallel={t} needs a tensor-parallel plan for the model's layers; "
            f"model.kind={m.kind} has none (allowed: {', '.join(TENSOR_PARALLEL_MODELS)}), or "
            "use strategy.tensor_parallel=1 (fsdp alone shards any model)"
        )
    if not MODEL_KINDS[m.kind].shape_in_spec:  # sizes checked on the built model
        return
    sizes = (
        ("model.n_head", m.n_head, "heads are split whole"),
        ("model.n_embd", m.n_embd, "the width is split"),
        ("data.vocab_size", cfg.data.vocab_size, "the embedding and LM head are split by token"),
        ("model.block_size", m.block_size, "sequence parallelism splits the sequence"),
    )
    for key, value, why in sizes:
        if value % t:
            raise ConfigError(
                f"{key}={value} is not divisible by strategy.tensor_parallel={t} ({why}); "
                f"allowed: a tensor_parallel that divides {value}, or a {key} that is a "
                f"multiple of {t}"
            )


def _validate_companions(cfg: JobConfig) -> None:
    s = cfg.strategy
    if s.offload_optimizer != "none":
        raise ConfigError(
            f"strategy.offload_optimizer={s.offload_optimizer} is DeepSpeed ZeRO's; with "
            "strategy.kind=fsdp use strategy.offload_param=cpu (FSDP2 then keeps parameters, "
            "gradients and the optimizer step on the host)"
        )
    if cfg.compression.kind != "none":
        raise ConfigError(
            f"compression.kind={cfg.compression.kind} compresses DDP's gradient all-reduce; "
            "strategy.kind=fsdp reduce-scatters gradients instead (allowed: none, or "
            "strategy.kind=ddp)"
        )
    if data_kind_of(cfg).streams and s.tensor_parallel > 1:
        raise ConfigError(
            f"data.kind={cfg.data.kind} with strategy.tensor_parallel={s.tensor_parallel}: Ray "
            "Data's shards are per worker, and tensor-parallel ranks must see the same rows; use "
            "an indexed source (markov, tokens, text, arrays, ...) or tensor_parallel=1"
        )
