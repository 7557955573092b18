"""Activation bytes per rank: what the forward pass keeps for the backward pass.

Two models. `rank_activation_bytes`, which the plan uses, counts what trainstack's own
GPT (and a Hugging Face Llama) save, derived from their code op by op and checked
against `SavedActivationMeter` on real forwards (tests/unit/test_planner.py).
`paper_rank_activation_bytes` is Korthikanti et al. 2022, kept for reference: it
assumes Megatron's attention, which keeps the s × s scores that fused attention does not.

**The paper** ("Reducing Activation Recomputation in Large Transformer Models", arXiv
2205.05198, Section 4). One layer with s tokens, micro-batch b, width h, a heads and
t-way tensor parallelism keeps, in 16-bit activations with 1-byte dropout masks:

- no parallelism (eq. 1):                       sbh(34 + 5as/h)
- tensor parallel (eq. 2):                      sbh(10 + 24/t + 5as/(ht))
- tensor + sequence parallel (eq. 3):           sbh/t · (34 + 5as/h)
- full recomputation (Section 4.3, Table 2):    each layer's input only, 2sbh
                                                (sharded /t under sequence parallelism)

and a pipeline's first stage keeps L/p layers for each micro-batch in flight: p of them
under 1F1B (eq. 4: as much as the whole model's L layers of one micro-batch), all m
under GPipe. With e bytes an activation element and m a mask element, 34sbh is
(16e + 2m)·sbh, 5as²b is (2e + m)·as²b, eq. 2's replicated 10sbh is (4e + 2m)·sbh and
its 24sbh/t is 12e·sbh/t (`ActivationDtype`; e = 2, m = 1 gives the paper's numbers).

**trainstack's GPT** (models/gpt.py), one block, with e the bytes of a matmul's input
and output, r of the residual stream (`Precision`), and w of autocast's weight copies:

    norms      2r·sbh + 4r·sb     ln_1 and ln_2 inputs, their mean and 1/std
    norm outs  2e·sbh             the inputs of q/k/v (one tensor) and c_fc; 4e·sbh
                                  under autocast, which casts the fp32 norm output once
                                  for each matmul reading it (weights' casts are cached)
    attention  4e·sbh + 4asb      SDPA's q, k, v, output (c_proj's input: same storage)
                                  and fp32 logsumexp; no s × s tensor
    MLP        8e·sbh             GELU's input and output (4h wide each)
    dropout    2m·sbh             resid_drop's and the MLP's masks (dropout > 0)
    weights    12h²·w             autocast's bf16 copies of the six matmul weights

in fp32 without dropout 16 elements a token and width, as the paper's 34sbh without
its masks, and no 5as²b. The ends: the embedding keeps the token and position ids (8sb + 8s) and its
dropout mask (m·sbh); the head keeps ln_f's input and statistics, its output (e·sbh),
the LM head's weight copy (w·Vh) and cross-entropy's fp32 log-probabilities (4sbV)
and targets (8sb); with `model.fused_loss`, instead of ln_f's output and all of those,
the gradients the fused loss computes in the forward: r·sbh for the hidden states and
the weight's own dtype × Vh for the head's weight (no logits). Precisions (`FP32`,
`AUTOCAST_BF16`, `BF16_WEIGHTS`): fp32 has e = r = 4, w = 0; bf16 autocast over fp32
weights (DDP, a pipeline, FSDP without sharding) e = 2, r = 4 (embeddings and residual
adds stay fp32), w = 2; bf16 weights
(DeepSpeed ZeRO, FSDP's mixed-precision policy) e = r = 2, w = 0.

**Tensor parallelism** (strategies/tensor_parallel.py, always sequence-parallel for the
GPT) divides everything by t except the norm outputs: the column-parallel layers
all-gather their input and autograd keeps the gathered copy, so 2e·sbh stay whole on
every rank (Megatron keeps only its shard and gathers again in the backward; torch's
`ColwiseParallel` does not). Likewise ln_f's output in the head; the logits are whole
unless `loss_parallel`. Measured single-process on a fake two-rank process group.

**A Hugging Face Llama** (`llama_layer_bytes`; no sequence parallelism, so the norms and
the residual stream are whole on every rank and the rest /t), with g key/value heads
and intermediate size i: RMSNorm keeps its input in fp32, the normalised input and the
output, (4 + r + e)·sbh + 4sb, twice (the output 5e·sbh in all under autocast: q, k,
v, gate and up each cast it); attention q, output (2e·sbh) and k, v (2e·sbh·g/a) after
rotary, logsumexp, and the rotary cos and sin (2r·s·h/a); the SwiGLU MLP 4e·sbi (gate,
up, SiLU output, product); weights (2h² + 2h²g/a + 3hi)·w. The plan's `TransformerShape`
carries neither g, i nor V, so `plan` gives a Hugging Face model the paper's
tensor-parallel formula (eq. 2) with fused attention: per layer at Llama-7B's shape
(s = h = 4096, a = g = 32, i = 11008, b = 1) 64 against this expression's 83 bytes a
token and width in fp32, 32 against 80 under bf16 autocast (its weight copies 24).

**Device.** On CUDA (what a plan is for) dropout is fused (`native_dropout`: 1-byte
masks) and SDPA's flash and memory-efficient kernels take dropout. On a CPU dropout
keeps a mask of the dropped tensor's dtype, and SDPA with dropout falls back to its
math kernel, which keeps fp32 copies of q, k, v, the softmax, its dropout mask and the
dropped probabilities: 12·sbh + 12as²b instead of 4e·sbh + 4asb (`device="cpu"`,
which the tests measure). The CUDA figures are read from torch's kernels, not measured.

**Recomputation** (`model.activation_checkpointing`) keeps each block's input (r·sbh,
/t sequence-parallel); the backward recomputes one block at a time, whose saved
tensors come back while the head's are already freed, so a stage's peak is the larger
of its forward and that. **Pipelines**: the first stage holds its L/p layers and the
embedding for each micro-batch in flight (p under 1F1B, m under GPipe); the last stage
its layers and the head for one micro-batch (1F1B) or m (GPipe); a rank's figure is the
larger of the two.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from trainstack.planner.workload import TransformerShape

PipelineSchedule = Literal["1f1b", "gpipe"]
Family = Literal["gpt", "llama"]
Device = Literal["cuda", "cpu"]

ID_BYTES = 8
"""int64 token ids and targets."""
FP32_BYTES = 4


# ---- the paper ---------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ActivationDtype:
    """Bytes an activation element and a dropout-mask element take (the paper's model)."""

    element_bytes: int = 2
    """e: 2 in 16-bit training (the paper), 4 in fp32."""
    mask_bytes: int = 1
    """m: 1 for a dropout mask (the paper), 0 without dropout."""
    attention_scores: bool = True
    """Whether the s × s attention scores are kept (the paper); not with fused attention."""


PAPER = ActivationDtype()
"""The paper's assumptions: 16-bit activations, 1-byte masks, scores kept."""


def layer_activation_bytes(
    *,
    seq: int,
    micro_batch: int,
    hidden: int,
    heads: int,
    tensor_parallel: int = 1,
    sequence_parallel: bool = False,
    recompute: bool = False,
    dtype: ActivationDtype = PAPER,
) -> float:
    """Bytes one transformer layer keeps in the paper's model (module docstring)."""
    s, b, h, a, t = seq, micro_batch, hidden, heads, tensor_parallel
    e, m = dtype.element_bytes, dtype.mask_bytes
    sbh = s * b * h
    if recompute:
        stored = e * sbh
        return stored / t if sequence_parallel else stored
    scores = (2 * e + m) * a * s * s * b if dtype.attention_scores else 0
    if sequence_parallel or t == 1:
        return ((16 * e + 2 * m) * sbh + scores) / t
    return (4 * e + 2 * m) * sbh + (12 * e * sbh + scores) / t


def pipeline_in_flight(*, stages: int, micro_batches: int, schedule: PipelineSchedule) -> int:
    """Micro-batches whose activations the first stage holds at once: under 1F1B p (or
    m when fewer), under GPipe all m (every forward runs before any backward)."""
    return min(stages, micro_batches) if schedule == "1f1b" else micro_batches


def paper_rank_activation_bytes(
    shape: TransformerShape,
    *,
    micro_batch: int,
    tensor_parallel: int = 1,
    stages: int = 1,
    micro_batches: int = 1,
    schedule: PipelineSchedule = "1f1b",
    recompute: bool = False,
    dtype: ActivationDtype = PAPER,
) -> float:
    """The paper's peak on the first pipeline stage: L/p layers for each micro-batch in
    flight, and with recomputation one layer's full activations on top of the stored
    inputs. The embedding, final norm and logits are not counted."""

    def layer(*, recomputed: bool) -> float:
        return layer_activation_bytes(
            seq=shape.seq,
            micro_batch=micro_batch,
            hidden=shape.hidden,
            heads=shape.heads,
            tensor_parallel=tensor_parallel,
            sequence_parallel=shape.sequence_parallel and tensor_parallel > 1,
            recompute=recomputed,
            dtype=dtype,
        )

    in_flight = pipeline_in_flight(stages=stages, micro_batches=micro_batches, schedule=schedule)
    held = shape.layers // stages * in_flight
    if recompute:
        return held * layer(recomputed=True) + layer(recomputed=False)
    return held * layer(recomputed=False)


# ---- trainstack's models ---------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Precision:
    """Bytes of the tensors a trainstack forward saves (module docstring)."""

    activation_bytes: int
    """e: a matmul's input and output."""
    residual_bytes: int
    """r: the residual stream (norm inputs, block inputs, embeddings)."""
    weight_copy_bytes: int
    """w: autocast's low-precision copy of each matmul weight, which the matmul saves."""
    weight_bytes: int = 4
    """A weight's own element: 4 (fp32 weights, autocast or not), 2 (bf16 weights), 8."""

    @property
    def casts_norm_outputs(self) -> bool:
        """Whether a norm's output (residual dtype) is cast for each matmul reading it:
        autocast caches the casts of weights, not of activations, so q, k and v each keep
        their own copy of the norm's output."""
        return self.activation_bytes != self.residual_bytes


FP32 = Precision(activation_bytes=4, residual_bytes=4, weight_copy_bytes=0)
FP64 = Precision(activation_bytes=8, residual_bytes=8, weight_copy_bytes=0, weight_bytes=8)
"""`train.precision: fp64` (numerics checks): every activation in float64."""
AUTOCAST_BF16 = Precision(activation_bytes=2, residual_bytes=4, weight_copy_bytes=2)
"""bf16 autocast over fp32 weights: DDP, pipelines, FSDP without sharding (tp only)."""
BF16_WEIGHTS = Precision(activation_bytes=2, residual_bytes=2, weight_copy_bytes=0, weight_bytes=2)
"""bf16 weights: DeepSpeed ZeRO's bf16 module, FSDP's mixed-precision policy."""


@dataclass(frozen=True, kw_only=True)
class Architecture:
    """What the trainstack expressions need beyond `TransformerShape`."""

    family: Family = "gpt"
    """`gpt`: models/gpt.py; `llama`: a Hugging Face Llama (models/hf.py)."""
    vocab: int = 0
    """V: the logits' width (0: the head is not counted)."""
    dropout: bool = False
    """model.dropout > 0 (for a Llama, its attention dropout)."""
    kv_heads: int = 0
    """llama: key/value heads (0: as many as the query heads)."""
    ffn_hidden: int = 0
    """llama: the MLP's intermediate size (0: 4h)."""
    fused_loss: bool = False
    """gpt: the head's loss computed without the logits (`model.fused_loss`)."""
    moe: MoELayers | None = None
    """gpt: its mixture-of-experts blocks (`model.moe`)."""


@dataclass(frozen=True, kw_only=True)
class MoELayers:
    """The GPT's MoE blocks, for `moe_mlp_bytes`."""

    experts: int
    top_k: int
    expert_hidden: int
    blocks: int
    """How many of the layers are MoE blocks (the rest keep the dense MLP)."""


def moe_mlp_bytes(*, tokens: int, hidden: int, moe: MoELayers, e: int, r: int, w: int) -> float:
    """What an MoE block's MLP keeps (models/moe.py) in place of the dense MLP's 8e·sbh,
    for N tokens routed evenly (each expert padded to N·k/E rows): the fp32 router
    probabilities 4E, the normalised gates and their sum 4k + 4, six int64 index tensors
    of N·k (top-k, the kept order, two gathers' and the padded batch's two) 48k, the
    gate copy multiplied in 4k, the padded rows and the experts' output rows 2e·kh, the
    GELU's input and output 2e·k·h_e, the weighted rows summed back into the residual
    stream's dtype r·kh, per token; and autocast's copies of the router and expert
    weights w·(E·h + 2E·h·h_e)."""
    k, d, he, n = moe.top_k, hidden, moe.expert_hidden, tokens
    per_token = 4 * moe.experts + 4 + 56 * k + 2 * e * k * (d + he) + r * k * d
    return n * per_token + w * moe.experts * d * (1 + 2 * he)


def _mask_bytes(dropped_bytes: int, *, device: Device) -> int:
    """A dropout mask element: a bool on CUDA, the dropped tensor's dtype on a CPU."""
    return 1 if device == "cuda" else dropped_bytes


def _sdpa_bytes(
    *,
    seq: int,
    micro_batch: int,
    hidden: int,
    heads: int,
    kv_hidden: int,
    e: int,
    dropout: bool,
    device: Device,
) -> float:
    """What SDPA and the output projection keep: fused kernels q, k, v, the output (the
    projection's input, same storage) and an fp32 logsumexp a head and token; a CPU with
    dropout the math kernel's fp32 q, k, v (k and v repeated to every head), softmax,
    mask and dropped probabilities, and the output's contiguous copy."""
    tokens = seq * micro_batch
    if dropout and device == "cpu":
        return (3 * FP32_BYTES + e) * tokens * hidden + 3 * FP32_BYTES * heads * seq * tokens
    return e * (2 * hidden + 2 * kv_hidden) * tokens + FP32_BYTES * heads * tokens


def gpt_layer_bytes(
    *,
    seq: int,
    micro_batch: int,
    hidden: int,
    heads: int,
    tensor_parallel: int = 1,
    precision: Precision = FP32,
    dropout: bool = False,
    device: Device = "cuda",
) -> float:
    """Bytes one GPT block keeps on one of t sequence-parallel ranks (module docstring)."""
    s, b, h, t = seq, micro_batch, hidden, tensor_parallel
    e, r, w = precision.activation_bytes, precision.residual_bytes, precision.weight_copy_bytes
    sbh = s * b * h
    norms = 2 * r * sbh + 4 * r * s * b
    attention = _sdpa_bytes(
        seq=s,
        micro_batch=b,
        hidden=h,
        heads=heads,
        kv_hidden=h,
        e=e,
        dropout=dropout,
        device=device,
    )
    masks = 2 * _mask_bytes(e, device=device) * sbh if dropout else 0
    sharded = norms + attention + 8 * e * sbh + masks + 12 * h * h * w
    norm_outputs = (4 if precision.casts_norm_outputs else 2) * e * sbh  # q, k, v; c_fc
    return norm_outputs + sharded / t


def llama_layer_bytes(
    *,
    seq: int,
    micro_batch: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    ffn_hidden: int,
    tensor_parallel: int = 1,
    precision: Precision = FP32,
    dropout: bool = False,
    device: Device = "cuda",
) -> float:
    """Bytes one Llama decoder layer keeps on one of t tensor-parallel ranks (module
    docstring): the norms and rotary tables whole, attention and MLP /t."""
    s, b, h, t, i = seq, micro_batch, hidden, tensor_parallel, ffn_hidden
    e, r, w = precision.activation_bytes, precision.residual_bytes, precision.weight_copy_bytes
    sbh = s * b * h
    kv_hidden = h * kv_heads // heads
    norm_outputs = (5 if precision.casts_norm_outputs else 2) * e * sbh  # q, k, v; gate, up
    norms = 2 * (FP32_BYTES + r) * sbh + 2 * FP32_BYTES * s * b + norm_outputs
    whole = norms + 2 * r * s * h // heads  # and the rotary cos, sin
    attention = _sdpa_bytes(
        seq=s,
        micro_batch=b,
        hidden=h,
        heads=heads,
        kv_hidden=kv_hidden,
        e=e,
        dropout=dropout,
        device=device,
    )
    weights = (2 * h * h + 2 * h * kv_hidden + 3 * h * i) * w
    return whole + (attention + 4 * e * s * b * i + weights) / t


@dataclass(frozen=True, kw_only=True)
class _StageBytes:
    """One stage's bytes for one micro-batch: its embedding, its layers (full, and as
    stored under recomputation) and its head."""

    embedding: float
    layer: float
    stored_layer: float
    head: float
    recompute_keeps_input: bool
    """Whether the recomputed block saves its input itself (a LayerNorm does), so that
    the stored input counts once; a Llama's RMSNorm saves an fp32 copy of a bf16 input."""

    def peak(self, *, layers: int, in_flight: int, recompute: bool) -> float:
        if not recompute:
            return in_flight * (self.embedding + layers * self.layer + self.head)
        held = in_flight * (self.embedding + layers * self.stored_layer + self.head)
        # the block the backward recomputes comes back once the head's tensors are freed
        recomputed = self.layer - self.stored_layer * self.recompute_keeps_input
        return held + max(0.0, recomputed - self.head)


def _stage_bytes(
    shape: TransformerShape,
    arch: Architecture,
    *,
    micro_batch: int,
    tensor_parallel: int,
    precision: Precision,
    loss_parallel: bool,
    device: Device,
) -> _StageBytes:
    s, b, h, t, v = shape.seq, micro_batch, shape.hidden, tensor_parallel, arch.vocab
    e, r, w = precision.activation_bytes, precision.residual_bytes, precision.weight_copy_bytes
    sbh = s * b * h
    logits = FP32_BYTES * s * b * v / (t if loss_parallel else 1)
    head_ends = logits + ID_BYTES * s * b + FP32_BYTES + w * v * h / t
    if arch.family == "gpt":
        layer = gpt_layer_bytes(
            seq=s,
            micro_batch=b,
            hidden=h,
            heads=shape.heads,
            tensor_parallel=t,
            precision=precision,
            dropout=arch.dropout,
            device=device,
        )
        mask = _mask_bytes(r, device=device) * sbh / t if arch.dropout else 0
        if arch.moe is not None:  # MoE blocks keep the experts' tensors, not the MLP's
            mlp_mask = _mask_bytes(e, device=device) * sbh if arch.dropout else 0
            dense_mlp = 8 * e * sbh + 8 * h * h * w + mlp_mask
            routed = (
                layer
                - dense_mlp
                + moe_mlp_bytes(tokens=s * b, hidden=h, moe=arch.moe, e=e, r=r, w=w)
            )
            blocks = arch.moe.blocks
            layer = (layer * (shape.layers - blocks) + routed * blocks) / shape.layers
        ln_f = (r * sbh + 2 * r * s * b) / t
        if arch.fused_loss:  # the gradients it computed in the forward, no logits
            head = ln_f + r * sbh + precision.weight_bytes * v * h
        else:
            head = ln_f + e * sbh + head_ends
        return _StageBytes(
            embedding=ID_BYTES * (s * b + s) + mask,
            layer=layer,
            stored_layer=r * sbh / t,
            head=head,
            recompute_keeps_input=True,
        )
    layer = llama_layer_bytes(
        seq=s,
        micro_batch=b,
        hidden=h,
        heads=shape.heads,
        kv_heads=arch.kv_heads or shape.heads,
        ffn_hidden=arch.ffn_hidden or 4 * h,
        tensor_parallel=t,
        precision=precision,
        dropout=arch.dropout,
        device=device,
    )
    return _StageBytes(
        embedding=ID_BYTES * s * b,
        layer=layer,
        stored_layer=r * sbh,
        head=(FP32_BYTES + r + e) * sbh + FP32_BYTES * s * b + head_ends,
        recompute_keeps_input=r == FP32_BYTES,
    )


def rank_activation_bytes(
    shape: TransformerShape,
    *,
    micro_batch: int,
    arch: Architecture = Architecture(),
    precision: Precision = FP32,
    tensor_parallel: int = 1,
    stages: int = 1,
    micro_batches: int = 1,
    schedule: PipelineSchedule = "1f1b",
    recompute: bool = False,
    loss_parallel: bool = False,
    device: Device = "cuda",
) -> float:
    """Peak saved-activation bytes on the rank that holds most, for trainstack's GPT or
    a Hugging Face Llama (`arch`): the first pipeline stage (embedding and L/p layers
    for each micro-batch in flight) or the last (L/p layers and the head), the whole
    model without a pipeline. The figure `SavedActivationMeter` reads, plus, with
    recomputation, the block the backward recomputes (module docstring)."""
    per_stage = _stage_bytes(
        shape,
        arch,
        micro_batch=micro_batch,
        tensor_parallel=tensor_parallel,
        precision=precision,
        loss_parallel=loss_parallel,
        device=device,
    )
    layers = shape.layers // stages
    first_in_flight = pipeline_in_flight(
        stages=stages, micro_batches=micro_batches, schedule=schedule
    )
    if stages == 1:
        return per_stage.peak(layers=layers, in_flight=first_in_flight, recompute=recompute)
    first = replace(per_stage, head=0.0)
    last = replace(per_stage, embedding=0.0)
    last_in_flight = 1 if schedule == "1f1b" else micro_batches
    return max(
        first.peak(layers=layers, in_flight=first_in_flight, recompute=recompute),
        last.peak(layers=layers, in_flight=last_in_flight, recompute=recompute),
    )
