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

from trainstack.data.sharding import Batch
from trainstack.models.on_meta import has_meta_parameters
from trainstack.tasks import Task


def _cpu_attention(q: Any, k: Any, v: Any, *args: Any, out_shape: Any = None, **kw: Any) -> int:
    return int(sdpa_flop_count(q, k, v))


def _cpu_attention_backward(
    grad_out: Any, q: Any, k: Any, v: Any, *args: Any, out_shape: Any = None, **kw: Any
) -> int:
    return int(sdpa_backward_flop_count(grad_out, q, k, v))


_aten = torch.ops.aten
CPU_ATTENTION_FORMULAS = {
    _aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward,
}
"""torch counts its GPU attention kernels; the CPU kernel takes the same formulas
(arguments are tensor shapes: FlopCounterMode passes shapes to custom formulas)."""


def count_training_flops(model: nn.Module, batch: Batch, *, task: Task) -> int:
    """FLOPs of one forward + backward pass of `model` on `batch` (all its samples). A
    model whose parameters are on the meta device (a pretrained one read rank by rank)
    is counted on a copy of fake tensors: shapes alone, no storage (transformers skips
    its data-dependent checks on fake tensors, which meta ones fail)."""
    if has_meta_parameters(model):
        from torch._subclasses.fake_tensor import FakeTensorMode

        twin = copy.deepcopy(model)
        with FakeTensorMode(allow_non_fake_inputs=True):
            return count_training_flops(twin.to_empty(device="cpu"), batch, task=task)
    inputs, targets = batch
    saved_grads = {p: p.grad for p in model.parameters()}
    with (
        torch.random.fork_rng(devices=[]),
        FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FORMULAS) as counter,
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
