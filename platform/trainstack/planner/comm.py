"""Bytes one rank sends per optimizer step, under ring collectives.

Counted as `strategies.comm_count.CollectiveBytes` counts what really runs, for a group
of n ranks: an all-gather sends (n-1) × this rank's shard, a reduce-scatter (n-1)/n of
its input, an all-reduce 2(n-1)/n of the buffer (a reduce-scatter then an
all-gather). A "pass" below is one reduce-scatter or all-gather of a whole tensor:
(n-1)/n of its bytes. Ψ parameters, e bytes a training-dtype element, A gradient
accumulation steps (micro-batches a rank runs per step):

- ddp: 2 passes of 4Ψ (one all-reduce of fp32 gradients, at the last micro-batch); with
  expert parallelism ep, the dense 4(Ψ − Ψ_e) over all N and each expert slice's
  4Ψ_e/ep over its N/ep replicas, plus the tokens' all-to-alls: per MoE block, of the T
  tokens a rank routes in a step, 4·T·k·(ep − 1)/ep rows of h elements leave the rank
  (dispatch and combine, forward and backward; even routing).
- zero-1: 2 passes of eΨ (reduce-scatter gradients, all-gather updated parameters);
  zero-2: A + 1 (a reduce-scatter every micro-batch); zero-3: 3A (an all-gather for
  each forward and backward, a reduce-scatter).
- fsdp, shard degree s, over s of the tp-local Ψ/t: 2A passes of eΨ/t (A without
  resharding after the forward) and one of 4Ψ/t (the fp32 gradient reduce-scatter);
  HSDP adds an all-reduce of 4Ψ/(t·s) over the r replicas; the gradient norm an
  8-byte all-reduce per sharded mesh dimension.
- tensor parallel t: (t-1)/t of the residual stream sbh·e, 8 times per block
  (forward 2 all-gathers and 2 reduce-scatters, backward the same; without sequence
  parallelism 2 all-reduces each way, the same bytes) and 4 times at the embedding
  and head; 4 more per block when the forward is recomputed.
- pipeline p: sbh·e/t of activations forward per micro-batch and stage boundary, as
  much gradient back (a middle stage sends both); an all-reduce of the stage's
  4Ψ/(p·t) over the d replicas.

These are the formulas `ZeROStrategy.comm_bytes_per_step` models and FSDP2's counted
bytes agree with (`benchmarks/mesh_layouts.py`: exact for fsdp and HSDP, within 1%
for tensor parallelism, whose few replicated norms and loss reductions are left out).
"""

from __future__ import annotations

import math

from trainstack.planner.layouts import Layout

FP32_BYTES = 4
NORM_BYTES = 8
"""The gradient norm's float64 partial sum, all-reduced once per sharded mesh dimension
(`strategies.mesh.squared_norm`)."""


def ring_pass(nbytes: int, n: int) -> int:
    """One reduce-scatter (or all-gather) of a whole `nbytes` tensor over n ranks."""
    return (n - 1) * nbytes // n


def all_reduce(nbytes: int, n: int) -> int:
    """A ring all-reduce of an `nbytes` buffer over n ranks."""
    return 2 * (n - 1) * nbytes // n


def data_parallel_bytes(
    layout: Layout,
    *,
    params: int,
    element_bytes: int,
    accumulation: int,
    expert_params: int = 0,
    trainable: int | None = None,
) -> int:
    """Bytes per step for the gradients and parameters of `layout` (module docstring);
    tensor parallelism's activations are `tensor_parallel_bytes`. `trainable`: the
    parameters that train (LoRA's adapters; default all): only their gradients are
    reduced, while sharded layouts still gather every parameter for compute."""
    psi, n, e = params, layout.devices, element_bytes
    g = psi if trainable is None else trainable
    if layout.kind == "ddp":
        ep = layout.expert_parallel
        dense = all_reduce(FP32_BYTES * (g - expert_params), n)
        return dense + all_reduce(FP32_BYTES * expert_params // ep, n // ep)
    if layout.kind == "zero":
        if layout.stage == 3:  # two gathers of every parameter, one reduce-scatter of grads
            return accumulation * (2 * ring_pass(e * psi, n) + ring_pass(e * g, n))
        passes = {1: 2, 2: accumulation + 1}[layout.stage]
        return passes * ring_pass(e * g, n)
    t = layout.tensor_parallel
    if layout.kind == "pipeline":
        return all_reduce(FP32_BYTES * g // (layout.stages * t), layout.data_parallel)
    s, r = layout.shard, layout.replicate
    gathers = (2 if layout.reshard_after_forward else 1) * accumulation
    fsdp = gathers * ring_pass(e * psi // t, s) + ring_pass(FP32_BYTES * g // t, s)
    hsdp = all_reduce(FP32_BYTES * g // (t * s), r)
    norm = sum(all_reduce(NORM_BYTES, d) for d in (s, t))
    return fsdp + hsdp + norm


def expert_all_to_all_bytes(
    *, tokens: int, top_k: int, hidden: int, element_bytes: int, expert_parallel: int, blocks: int
) -> int:
    """Bytes a rank sends by all-to-all in a step for `tokens` routed tokens (module
    docstring): what `MoE.a2a_bytes` counts, with even routing."""
    ep = expert_parallel
    return 4 * tokens * top_k * (ep - 1) * hidden * element_bytes * blocks // ep


def tensor_parallel_bytes(
    *,
    layers: int,
    tokens: int,
    hidden: int,
    tensor_parallel: int,
    element_bytes: int,
    recompute: bool,
) -> int:
    """Bytes per step that t-way tensor parallelism moves for `tokens` tokens (all of a
    replica's micro-batches): one collective of (t-1)/t of the residual stream, 8 per
    block, 4 at the embedding and head, 4 more per block when recomputing."""
    t = tensor_parallel
    collectives = (12 if recompute else 8) * layers + 4
    return collectives * ring_pass(tokens * hidden * element_bytes, t)


def pipeline_activation_bytes(
    *,
    stages: int,
    micro_batches: int,
    tokens_per_micro_batch: int,
    hidden: int,
    element_bytes: int,
    tensor_parallel: int,
) -> int:
    """Bytes the busiest stage sends across its boundaries per step: each micro-batch's
    activations forward and their gradients back (sequence-sharded /t under tensor
    parallelism); a middle stage does both, the first and last one each."""
    boundary = tokens_per_micro_batch * hidden * element_bytes // tensor_parallel
    directions = 2 if stages > 2 else 1
    return micro_batches * directions * boundary


def parameter_server_bytes(*, params: int) -> int:
    """Bytes a parameter-server worker pushes per step: its fp32 gradients, 4Ψ (it pulls
    as much back)."""
    return FP32_BYTES * params


# ---- compressed DDP (compression/: what `CommStats.wire_bytes` counts) ---------------


def topk_bytes(*, params: int, ratio: float, devices: int) -> int:
    """Top-k: each rank all-gathers k = ⌈ratio·Ψ⌉ int32 indices and fp32 values (8k
    bytes): (N-1)·8k sent. Counted per tensor in trainstack (⌈ratio·numel⌉ each, small
    tensors dense), so this is the large-model limit."""
    return (devices - 1) * 8 * math.ceil(ratio * params)


def randk_bytes(*, params: int, ratio: float, devices: int) -> int:
    """Random-k: the same k coordinates on every rank, so the k fp32 values (4k bytes)
    are all-reduced."""
    return all_reduce(4 * math.ceil(ratio * params), devices)


def powersgd_bytes(
    *, matrices: list[tuple[int, int]], dense_numel: int, rank: int, devices: int
) -> int:
    """PowerSGD rank r: each n × m gradient worth factoring ((n + m)r < nm) sends its
    factors P (n × r) and Q (m × r) in fp32, all-reduced; the rest goes dense."""
    low = 0
    for n, m in matrices:
        r = min(n, m, rank)
        low += (n + m) * r if (n + m) * r < n * m else n * m
    return all_reduce(FP32_BYTES * (low + dense_numel), devices)
