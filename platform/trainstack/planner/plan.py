"""Every candidate layout's memory, bytes and modelled step time; the one to run.

For each layout (`layouts.candidate_layouts`), micro-batch size b (the powers of two
that divide a data-parallel rank's share of the global batch, and that share itself)
and activation checkpointing off or on:

- **memory per rank** = model state on the device (`memory`) + activations of the
  rank that holds most (`activations`, 0 and reported unknown for a model without a
  transformer shape) + `Hardware.overhead_bytes` (the framework: CUDA context,
  communication buffers, the allocator's fragmentation, gathered shards in flight).
  Offloaded state is in host memory, which is not checked.
- **step time** = compute + communication + host transfers, added up, not overlapped
  (a real run overlaps some of them, so this is an upper bound):
  compute = 6Ψ FLOPs a token (8Ψ when recomputing: one more forward) / (N × peak ×
  efficiency), × (m + p - 1)/m for a pipeline's bubble (1F1B, m micro-batches);
  communication = `comm` bytes / bandwidth; host transfers (offload) = bytes to and
  from host memory / `Hardware.host_bandwidth`.

A layout's row is its best setting: of those that fit, the fastest, then without
recomputation, then the larger micro-batch; when none fits, the smallest. The
recommendation is the fastest row that fits; equal times go to the simpler layout
(`Layout.complexity`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trainstack.planner.activations import (
    AUTOCAST_BF16,
    BF16_WEIGHTS,
    FP32,
    FP64,
    ActivationDtype,
    Architecture,
    MoELayers,
    Precision,
    paper_rank_activation_bytes,
    rank_activation_bytes,
)
from trainstack.planner.comm import (
    FP32_BYTES,
    data_parallel_bytes,
    expert_all_to_all_bytes,
    pipeline_activation_bytes,
    tensor_parallel_bytes,
)
from trainstack.planner.layouts import Layout, candidate_layouts
from trainstack.planner.memory import StateBytes, model_state_bytes
from trainstack.planner.workload import Workload

FRAMEWORK_OVERHEAD_BYTES = 2**30
"""1 GiB a rank for what the model does not count (see the module docstring)."""


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """The devices a plan is for."""

    devices: int
    """N ranks, one device each."""
    memory_bytes: int
    """Memory of one device."""
    bandwidth: float
    """Bytes a second one rank sends to the others."""
    peak_flops: float
    """One device's peak FLOP/s in the training dtype."""
    efficiency: float = 0.4
    """The fraction of peak a training step reaches (model FLOP utilisation)."""
    host_bandwidth: float = 25e9
    """Bytes a second between a device and host memory (PCIe), for offloaded state."""
    overhead_bytes: int = FRAMEWORK_OVERHEAD_BYTES
    """Memory a rank needs beyond model state and activations."""


@dataclass(frozen=True, kw_only=True)
class Estimate:
    """One layout at one micro-batch size, with or without recomputation."""

    layout: Layout
    micro_batch: int
    """Samples a rank runs in one forward and backward."""
    accumulation: int
    """Micro-batches a data-parallel rank runs per optimizer step (a pipeline's m)."""
    recompute: bool
    """Activation checkpointing: recompute every block's forward in the backward."""
    state: StateBytes
    activations: float | None
    """None: the model has no transformer shape to model them from."""
    overhead: int
    comm_bytes: int
    """Bytes this rank sends per step."""
    compute_s: float
    comm_s: float
    host_s: float
    """Time moving offloaded state between host and device."""
    fits: bool

    @property
    def memory(self) -> float:
        """Device bytes a rank needs (activations counted as 0 when unknown)."""
        return self.state.device + (self.activations or 0.0) + self.overhead

    @property
    def step_s(self) -> float:
        return self.compute_s + self.comm_s + self.host_s

    def spec_keys(self) -> dict[str, Any]:
        """The job-spec keys that run this estimate (`--set` form)."""
        keys = self.layout.spec_keys()
        keys["train.micro_batch_size"] = self.micro_batch
        if self.layout.kind == "pipeline":
            keys["strategy.microbatches"] = self.accumulation
        if self.recompute:
            keys["model.activation_checkpointing"] = True
        return keys


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A row per candidate layout (its best setting), and the recommended row."""

    workload: Workload
    hardware: Hardware
    rows: list[Estimate]
    recommended: Estimate | None
    """None when nothing fits."""


def make_plan(
    workload: Workload,
    hardware: Hardware,
    *,
    runnable: Callable[[dict[str, Any]], bool] = lambda keys: True,
) -> Plan:
    """Estimate every candidate on `hardware` and pick the fastest that fits; settings
    whose spec keys are not `runnable` (the job's spec refuses them) are left out."""
    rows = []
    experts = workload.moe.experts if workload.moe else 0
    for layout in candidate_layouts(hardware.devices, workload.shape, experts=experts):
        settings = [e for e in _settings(workload, layout, hardware) if runnable(e.spec_keys())]
        fitting = [e for e in settings if e.fits]
        if fitting:
            rows.append(min(fitting, key=lambda e: (e.step_s, e.recompute, -e.micro_batch)))
        elif settings:
            rows.append(min(settings, key=lambda e: e.memory))
    fitting = [row for row in rows if row.fits]
    recommended = min(fitting, key=lambda r: (r.step_s, r.layout.complexity), default=None)
    return Plan(workload=workload, hardware=hardware, rows=rows, recommended=recommended)


def micro_batch_sizes(per_rank: int) -> list[int]:
    """Powers of two dividing `per_rank` samples, and `per_rank` itself."""
    sizes = [b for b in (2**i for i in range(per_rank.bit_length())) if per_rank % b == 0]
    return sorted({*sizes, per_rank})


def _settings(workload: Workload, layout: Layout, hardware: Hardware) -> list[Estimate]:
    d = layout.data_parallel
    if workload.global_batch % d:
        return []
    per_rank = workload.global_batch // d
    recompute = (False, True) if workload.shape is not None else (False,)
    return [
        estimate(workload, layout, hardware, micro_batch=b, recompute=r)
        for b in micro_batch_sizes(per_rank)
        for r in recompute
    ]


def estimate(
    workload: Workload, layout: Layout, hardware: Hardware, *, micro_batch: int, recompute: bool
) -> Estimate:
    """Memory, bytes and modelled time of `layout` at `micro_batch` (module docstring)."""
    w, e = workload, workload.element_bytes
    accumulation = w.global_batch // (layout.data_parallel * micro_batch)
    state = model_state_bytes(
        layout,
        params=w.params,
        element_bytes=e,
        optimizer_bytes=w.optimizer_bytes,
        weight_bytes=w.weight_bytes,
        expert_params=w.moe.expert_params if w.moe else 0,
        trainable=w.trainable,
        reference_copy=w.reference_copy,
    )
    activations = _activations(
        w, layout, micro_batch=micro_batch, m=accumulation, recompute=recompute
    )
    comm = data_parallel_bytes(
        layout,
        params=w.params,
        element_bytes=e,
        accumulation=accumulation,
        expert_params=w.moe.expert_params if w.moe else 0,
        trainable=w.trainable,
    )
    if w.moe is not None and layout.expert_parallel > 1 and w.shape is not None:
        comm += expert_all_to_all_bytes(
            tokens=w.global_batch // layout.data_parallel * w.tokens_per_sample,
            top_k=w.moe.top_k,
            hidden=w.shape.hidden,
            element_bytes=e,
            expert_parallel=layout.expert_parallel,
            blocks=w.moe.blocks,
        )
    if w.shape is not None:
        comm += _activation_comm(
            w, layout, micro_batch=micro_batch, m=accumulation, recompute=recompute
        )
    flops = (8 if recompute else 6) * w.active_params * w.global_batch * w.tokens_per_sample
    compute_s = flops / (hardware.devices * hardware.peak_flops * hardware.efficiency)
    if layout.kind == "pipeline":
        compute_s *= (accumulation + layout.stages - 1) / accumulation
    memory = state.device + (activations or 0.0) + hardware.overhead_bytes
    return Estimate(
        layout=layout,
        micro_batch=micro_batch,
        accumulation=accumulation,
        recompute=recompute,
        state=state,
        activations=activations,
        overhead=hardware.overhead_bytes,
        comm_bytes=comm,
        compute_s=compute_s,
        comm_s=comm / hardware.bandwidth,
        host_s=_host_bytes(w, layout, accumulation=accumulation) / hardware.host_bandwidth,
        fits=memory <= hardware.memory_bytes,
    )


def _activations(
    w: Workload, layout: Layout, *, micro_batch: int, m: int, recompute: bool
) -> float | None:
    """trainstack's GPT and a Hugging Face Llama by their own expressions (what
    `SavedActivationMeter` reads on them); other Hugging Face families by the paper's
    tensor-parallel formula with fused attention. Under context parallelism a rank holds
    1/c of every row's tokens and its ring keeps what fused attention keeps: the same
    expressions for a sequence of s / c."""
    shape = w.shape
    if shape is None:
        return None
    if layout.context_parallel > 1:
        shape = dataclasses.replace(shape, seq=shape.seq // layout.context_parallel)
    if shape.family not in ("gpt", "llama"):
        dtype = ActivationDtype(
            element_bytes=w.element_bytes, mask_bytes=int(w.dropout), attention_scores=False
        )
        return paper_rank_activation_bytes(
            shape,
            micro_batch=micro_batch,
            tensor_parallel=layout.tensor_parallel,
            stages=layout.stages,
            micro_batches=m,
            recompute=recompute,
            dtype=dtype,
        )
    arch = Architecture(
        family="gpt" if shape.family == "gpt" else "llama",
        vocab=shape.vocab,
        dropout=w.dropout,
        kv_heads=shape.kv_heads,
        ffn_hidden=shape.ffn_hidden,
        fused_loss=w.fused_loss,
        moe=MoELayers(
            experts=w.moe.experts,
            top_k=w.moe.top_k,
            expert_hidden=w.moe.expert_hidden,
            blocks=w.moe.blocks,
        )
        if w.moe
        else None,
    )
    return rank_activation_bytes(
        shape,
        micro_batch=micro_batch,
        arch=arch,
        precision=_precision(w, layout),
        tensor_parallel=layout.tensor_parallel,
        stages=layout.stages,
        micro_batches=m,
        recompute=recompute,
        loss_parallel=layout.tensor_parallel > 1,
    )


def _precision(w: Workload, layout: Layout) -> Precision:
    """fp32; under bf16, ZeRO's bf16 module and FSDP's mixed-precision policy (when it
    shards) compute on bf16 weights, the others autocast over fp32 weights."""
    if w.element_bytes == 2 * FP32_BYTES:
        return FP64
    if w.element_bytes == FP32_BYTES:
        return FP32
    sharded_by_fsdp = layout.kind == "fsdp" and layout.data_parallel * layout.context_parallel > 1
    return BF16_WEIGHTS if layout.kind == "zero" or sharded_by_fsdp else AUTOCAST_BF16


def _activation_comm(
    w: Workload, layout: Layout, *, micro_batch: int, m: int, recompute: bool
) -> int:
    """Tensor parallelism's and a pipeline's activation bytes per step."""
    assert w.shape is not None
    tokens = micro_batch * w.tokens_per_sample
    sent = 0
    if layout.tensor_parallel > 1:
        sent += tensor_parallel_bytes(
            layers=w.shape.layers // layout.stages,
            tokens=m * tokens,
            hidden=w.shape.hidden,
            tensor_parallel=layout.tensor_parallel,
            element_bytes=w.element_bytes,
            recompute=recompute,
        )
    if layout.kind == "pipeline":
        sent += pipeline_activation_bytes(
            stages=layout.stages,
            micro_batches=m,
            tokens_per_micro_batch=tokens,
            hidden=w.shape.hidden,
            element_bytes=w.element_bytes,
            tensor_parallel=layout.tensor_parallel,
        )
    if layout.context_parallel > 1:
        sent += ring_attention_bytes(
            layers=w.shape.layers,
            tokens=m * tokens,
            hidden=w.shape.hidden,
            context_parallel=layout.context_parallel,
            element_bytes=w.element_bytes,
            recompute=recompute,
        )
    return sent


def ring_attention_bytes(
    *,
    layers: int,
    tokens: int,
    hidden: int,
    context_parallel: int,
    element_bytes: int,
    recompute: bool,
) -> int:
    """Bytes a rank sends per step in context parallelism's rings
    (`strategies/context_parallel.py`), for `tokens` tokens of the rows its group
    shares: in each layer's forward its keys and values go round c - 1 times; in the
    backward keys, values and their gradients c - 1 times and the gradients once more
    (and with recomputation the forward's ring again). Each piece is its 1/c of the
    tokens × the width: e·sbh/c · (6c - 4), + 2(c - 1) recomputing."""
    c = context_parallel
    piece = element_bytes * tokens * hidden // c
    passes = 2 * (c - 1) + 4 * (c - 1) + 2 + (2 * (c - 1) if recompute else 0)
    return layers * passes * piece


def _host_bytes(w: Workload, layout: Layout, *, accumulation: int) -> int:
    """Bytes between device and host per step for offloaded state: ZeRO's gradient
    partition down and updated parameters up (and, offloading parameters, the partition
    up for every forward and backward); FSDP's fp32 shard up for every all-gather and
    its gradients down. The optimizer's time on the CPU is not modelled."""
    psi, n, e = w.params, layout.devices, w.element_bytes
    trained = psi if w.trainable is None else w.trainable
    moved = 0
    if layout.kind == "zero" and layout.offload_optimizer:
        moved += 2 * e * trained // n
    if layout.kind == "zero" and layout.offload_param:
        moved += 2 * accumulation * e * psi // n
    if layout.kind == "fsdp" and layout.offload_param:
        shard = FP32_BYTES * psi // (layout.shard * layout.tensor_parallel)
        gathers = 2 if layout.reshard_after_forward else 1
        moved += (gathers * accumulation + 1) * shard
    return moved
