"""Training FLOPs of any model: its own `flops_per_token()`, else counted once.

Counting runs one forward and backward of a micro-batch under torch's
`FlopCounterMode`, which adds up the FLOPs of matmuls, convolutions and attention as
torch dispatches them (elementwise ops, norms and lookups count as zero, as in the
analytic formulas). The model's gradients and the RNG are left as they were.
Attention counts its full score matrix (causal masking is not subtracted) and its
backward recomputes the scores, as torch's formulas do.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import (
    FlopCounterMode,
    sdpa_backward_flop_count,
    sdpa_flop_count,
)

from trainstack.compat import torch as torch_compat
from trainstack.data.sharding import Batch
from trainstack.models.on_meta import has_meta_parameters
from trainstack.tasks import Task


def _cpu_attention(q: Any, k: Any, v: Any, *args: Any, out_shape: Any = None, **kw: Any) -> int:
    return int(sdpa_flop_count(q, *_query_heads(q, k, v)))


def _cpu_attention_backward(
    grad_out: Any, q: Any, k: Any, v: Any, *args: Any, out_shape: Any = None, **kw: Any
) -> int:
    return int(sdpa_backward_flop_count(grad_out, q, *_query_heads(q, k, v)))


def _query_heads(q: Any, *shapes: Any) -> list[tuple[int, ...]]:
    """Key and value shapes [B, H, T, D] with the query's heads: grouped-query attention
    shares each key/value head between several query heads, and the kernel computes
    every query head's scores (torch's formulas do so themselves from 2.12 on)."""
    return [(*shape[:-3], q[-3], *shape[-2:]) for shape in shapes]


def cpu_attention_formulas() -> dict[Any, Any]:
    """torch counts its GPU attention kernels; the CPU kernel takes the same formulas
    (arguments are tensor shapes: FlopCounterMode passes shapes to custom formulas).
    Empty where torch names that kernel otherwise (`torch_compat.cpu_attention_ops`):
    attention's FLOPs on CPU are then left out."""
    ops = torch_compat.cpu_attention_ops()
    if ops is None:
        return {}
    forward, backward = ops
    return {forward: _cpu_attention, backward: _cpu_attention_backward}


def count_training_flops(model: nn.Module, batch: Batch, *, task: Task) -> int:
    """FLOPs of one forward + backward pass of `model` on `batch` (all its samples). A
    model whose parameters are on the meta device (a pretrained one read rank by rank)
    is counted on a copy of fake tensors: shapes alone, no storage (transformers skips
    its data-dependent checks on fake tensors, which meta ones fail); where torch has no
    fake tensors (`torch_compat.fake_tensor_mode`), estimated as 6 FLOPs per parameter
    and target (token, or sample for `classify`): a dense model's forward and backward."""
    if has_meta_parameters(model):
        fake = torch_compat.fake_tensor_mode()
        if fake is None:
            _, targets = batch
            return 6 * sum(p.numel() for p in model.parameters()) * targets.numel()
        twin = copy.deepcopy(model)
        with fake:
            return count_training_flops(twin.to_empty(device="cpu"), batch, task=task)
    inputs, targets = batch
    saved_grads = {p: p.grad for p in model.parameters()}
    with (
        torch.random.fork_rng(devices=[]),
        FlopCounterMode(display=False, custom_mapping=cpu_attention_formulas()) as counter,
    ):
        loss = task.loss(task.outputs(model, inputs, targets), targets, inputs=inputs)
        loss.backward()
    for p, grad in saved_grads.items():
        p.grad = grad
    return int(counter.get_total_flops())


def flops_per_token(model: nn.Module, batch: Batch, *, task: Task) -> int:
    """Training FLOPs per token (`lm`) or per sample (`classify`): the model's own
    `flops_per_token()` if it has one, else counted on `batch`."""
    own = getattr(model, "flops_per_token", None)
    if callable(own):
        return int(own())
    _, targets = batch
    return count_training_flops(model, batch, task=task) // max(1, targets.numel())
