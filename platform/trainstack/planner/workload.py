"""What a plan needs to know of a job: its parameter count, its transformer shape (when
it has one), the samples in a step, and the bytes its dtypes and optimizer take."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainstack.config import ConfigError, JobConfig, config_from_dict, config_to_dict, set_key
from trainstack.kinds import MODEL_KINDS

FP32_BYTES = 4


@dataclass(frozen=True, kw_only=True)
class TransformerShape:
    """The sizes the activation and tensor-parallel formulas take."""

    layers: int
    """L: transformer blocks."""
    hidden: int
    """h: the residual stream's width."""
    heads: int
    """a: attention heads."""
    seq: int
    """s: tokens per sample."""
    sequence_parallel: bool = True
    """Whether trainstack's tensor-parallel plan also splits the sequence between
    blocks: the GPT's does; a Hugging Face Llama's does not (rotary embeddings need the
    whole sequence)."""
    family: str = "gpt"
    """`gpt` (models/gpt.py) or the Hugging Face `model_type` (`llama`, ...)."""
    vocab: int = 0
    """V: the logits' width."""
    kv_heads: int = 0
    """Key/value heads (0: as many as `heads`)."""
    ffn_hidden: int = 0
    """The MLP's inner width (0: 4h)."""


@dataclass(frozen=True, kw_only=True)
class ExpertShape:
    """A mixture of experts, as the plan counts it (`model.moe`)."""

    experts: int
    """E: experts per MoE block."""
    top_k: int
    """k: experts a token is routed to."""
    blocks: int
    """MoE blocks in the model."""
    expert_params: int
    """Ψ_e: the parameters of every expert of every MoE block (part of Ψ)."""
    expert_hidden: int
    """Each expert's hidden width."""

    @property
    def idle_params(self) -> int:
        """Expert parameters a token does not use: (E − k)/E of Ψ_e."""
        return self.expert_params * (self.experts - self.top_k) // self.experts


ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp64": 8}
"""`train.precision` -> bytes of a training-dtype element."""


@dataclass(frozen=True, kw_only=True)
class Workload:
    """One optimizer step of a job, in the numbers the cost model takes."""

    params: int
    """Ψ: the model's parameters."""
    trainable: int | None = None
    """Ψ_t: the parameters that train, where fewer than Ψ do (LoRA's adapters); None: all."""
    reference_copy: bool = False
    """A frozen copy of the weights is held beside them (DPO's reference without LoRA)."""
    shape: TransformerShape | None
    """None for models without a known transformer shape: activations are not modelled."""
    global_batch: int
    """Samples in one optimizer step, over all data-parallel ranks."""
    tokens_per_sample: int
    """Tokens a sample trains on (`model.block_size` for `task.kind: lm`, else 1)."""
    element_bytes: int
    """Bytes of a training-dtype element: 4 in fp32, 2 in bf16, 8 in fp64 (activations,
    ZeRO's parameters and gradients, FSDP's gathered parameters)."""
    optimizer_bytes: int
    """Optimizer state per parameter: AdamW 8, SGD with momentum 4, without 0 (twice as
    much in fp64)."""
    weight_bytes: int = 4
    """Bytes of a weight (and its gradient) the torch engines keep: 4 (bf16 autocasts over
    fp32 weights), 8 in fp64."""
    dropout: bool
    """Whether dropout masks are kept (1 byte an element in the activation formulas)."""
    fused_loss: bool = False
    """The GPT head's loss without the logits (`model.fused_loss`): no `[B, T, V]` logits
    kept, so larger micro-batches fit."""
    moe: ExpertShape | None = None
    """The model's mixture of experts, if it has one."""

    @property
    def active_params(self) -> int:
        """Parameters a token's forward uses: all but the experts it is not routed to."""
        return self.params - (self.moe.idle_params if self.moe else 0)

    model: str
    """The model, for messages: `model.kind=gpt (n_layer=2, n_embd=64, n_head=2)`."""


def workload_from_spec(cfg: JobConfig) -> Workload:
    """The spec's model, batch, precision and optimizer as a `Workload`."""
    m = cfg.model
    params = parameter_count(cfg)
    trainable = trainable_parameter_count(cfg)
    shape = transformer_shape(cfg)
    element_bytes, optimizer, weight_bytes = state_element_bytes(cfg)
    name = f"model.kind={m.kind}"
    if shape is not None:
        name += f" (layers {shape.layers}, hidden {shape.hidden}, heads {shape.heads})"
    return Workload(
        params=params,
        trainable=trainable,
        reference_copy=cfg.frozen_reference,
        shape=shape,
        global_batch=cfg.train.global_batch_size,
        tokens_per_sample=cfg.tokens_per_sample,
        element_bytes=element_bytes,
        optimizer_bytes=optimizer,
        weight_bytes=weight_bytes,
        dropout=m.dropout > 0,
        fused_loss=m.fused_loss,
        moe=expert_shape(cfg),
        model=name,
    )


def state_element_bytes(cfg: JobConfig) -> tuple[int, int, int]:
    """Bytes of the spec's model state per parameter, as `planner/memory.py` takes them:
    a training-dtype element (ZeRO's parameters and gradients), the optimizer's state
    (AdamW 2 moments, SGD its momentum or nothing) and a torch engine's weight (4; 8 in
    fp64, where the optimizer's state doubles too)."""
    weight_bytes = 2 * FP32_BYTES if cfg.train.precision == "fp64" else FP32_BYTES
    optimizer = (
        2 * weight_bytes if cfg.optim.kind == "adamw" else weight_bytes * (cfg.optim.momentum > 0)
    )
    return ELEMENT_BYTES[cfg.train.precision], optimizer, weight_bytes


def parameter_count(cfg: JobConfig) -> int:
    """The model's parameters without allocating them: by formula for the built-in
    models, else built on the meta device; ConfigError saying why a build fails, or for
    `model.pretrained` (whose weights are not read to plan)."""
    import torch

    from trainstack.models import MODELS, build_model, num_params
    from trainstack.user_code import describe_exception

    m = cfg.model
    if m.kind in MODELS:
        numel, _ = MODELS[m.kind].count_parameters(m, vocab_size=cfg.data.vocab_size)
        return numel
    if m.pretrained:
        raise ConfigError(
            f"model.pretrained={m.pretrained}: trainstack plan reads no weights; allowed: "
            "plan the same model.hf without model.pretrained"
        )
    try:
        with torch.device("meta"):
            model = build_model(m, vocab_size=cfg.data.vocab_size, seed=cfg.train.seed)
    except ConfigError:
        raise
    except Exception as e:  # the user's code
        raise ConfigError(
            f"model.kind={m.kind}: building it on the meta device to count its parameters "
            f"raised {describe_exception(e)}"
        ) from None
    return num_params(model)


def trainable_parameter_count(cfg: JobConfig) -> int | None:
    """With `model.lora`, the adapters' parameters (the model built on the meta device
    with them: no weight allocated or read); None, where every parameter trains."""
    if not cfg.model.lora.rank:
        return None
    import torch

    from trainstack.models import build_model
    from trainstack.models.lora import trainable_parameters

    with torch.device("meta"):
        model = build_model(
            cfg.model,
            vocab_size=cfg.data.vocab_size,
            seed=cfg.train.seed,
            pretrained_on_meta=bool(cfg.model.pretrained),
        )
    return trainable_parameters(model)


def expert_shape(cfg: JobConfig) -> ExpertShape | None:
    """`model.moe`'s experts (trainstack's GPT), or None."""
    m = cfg.model
    if not m.moe.experts or not MODEL_KINDS[m.kind].moe_in_spec:
        return None
    from trainstack.models.gpt import expert_hidden, moe_blocks

    blocks, hidden = moe_blocks(m), expert_hidden(m)
    return ExpertShape(
        experts=m.moe.experts,
        top_k=m.moe.top_k,
        blocks=blocks,
        expert_params=blocks * m.moe.experts * 2 * m.n_embd * hidden,
        expert_hidden=hidden,
    )


def transformer_shape(cfg: JobConfig) -> TransformerShape | None:
    """The GPT's `n_layer`, `n_embd`, `n_head`, a Hugging Face config's
    `num_hidden_layers`, `hidden_size`, `num_attention_heads`, with `model.block_size`
    tokens; None for other models."""
    m, kind = cfg.model, MODEL_KINDS[cfg.model.kind]
    if kind.shape_in_spec:
        return TransformerShape(
            layers=m.n_layer,
            hidden=m.n_embd,
            heads=m.n_head,
            seq=m.block_size,
            vocab=cfg.data.vocab_size,
        )
    if kind.hf_config:
        from trainstack.models.hf import hf_config

        config = hf_config(m, vocab_size=cfg.data.vocab_size)
        return TransformerShape(
            layers=config.num_hidden_layers,
            hidden=config.hidden_size,
            heads=config.num_attention_heads,
            seq=m.block_size,
            sequence_parallel=False,
            family=config.model_type,
            vocab=config.vocab_size,
            kv_heads=getattr(config, "num_key_value_heads", 0) or 0,
            ffn_hidden=getattr(config, "intermediate_size", 0) or 0,
        )
    return None


def with_layout(
    cfg: JobConfig, keys: dict[str, Any], *, keep_compression: bool
) -> JobConfig | None:
    """The spec with its strategy replaced by `keys` (`--set` form), its compression kept
    or dropped (the plan does not model it), or None when the spec refuses that layout
    (its compression, data or model cannot go with it)."""
    raw = config_to_dict(cfg) | {"strategy": {}}
    if not keep_compression:
        raw["compression"] = {}
    for key, value in keys.items():
        raw = set_key(raw, key, value, what="the plan")
    try:
        return config_from_dict(raw)
    except ConfigError:
        return None
