"""The LM head and its cross-entropy in one step, never holding the `[N, V]` logits.

`linear_cross_entropy(hidden [N, C], weight [V, C], targets [N])` is
`cross_entropy(hidden @ weight.T, targets)` (mean over the targets that are not -100).
On a GPU with liger-kernel installed it is Liger's fused Triton kernel; elsewhere a
chunked torch version: the tokens go through in chunks of `chunk_elements // V`, each
chunk's logits are made, turned into its loss and its gradients with respect to the
hidden states and the weight (softmax minus one-hot, two matmuls), and freed. Only the
gradients (the size of `hidden` and of `weight`) are kept for the backward pass, which
scales them by the incoming gradient. At GPT-2's vocabulary (50,304) and 16 × 1024
tokens, the float32 logits alone are 3.3 GB, and their gradient as much again.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
from torch import nn

from trainstack.data.sharding import IGNORED_TARGET

CHUNK_ELEMENTS = 2**25
"""Logits per chunk of the torch version (128 MiB in float32)."""


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> torch.Tensor:
    """Mean cross-entropy of `hidden @ weight.T` against `targets`, without the logits."""
    if hidden.is_cuda and liger_available():
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        loss: torch.Tensor = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORED_TARGET)(
            weight, hidden, targets
        )
        return loss
    rows = max(1, chunk_elements // weight.shape[0])
    result: torch.Tensor = _ChunkedLinearCrossEntropy.apply(hidden, weight, targets, rows)
    return result


def liger_available() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, rows: int
    ) -> torch.Tensor:
        valid = targets != IGNORED_TARGET
        accumulate = torch.float64 if weight.dtype == torch.float64 else torch.float32
        count = valid.sum().clamp_min(1).to(accumulate)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=accumulate, device=weight.device)
        total = torch.zeros((), dtype=accumulate, device=hidden.device)
        for start in range(0, hidden.shape[0], rows):
            h, t, keep = (v[start : start + rows] for v in (hidden, targets, valid))
            logits = (h @ weight.t()).to(accumulate)
            lse = logits.logsumexp(-1)
            picked = logits.gather(1, t.clamp_min(0).unsqueeze(1)).squeeze(1)
            total += ((lse - picked) * keep).sum()
            grad = (logits - lse.unsqueeze(1)).exp_()  # softmax
            grad[torch.arange(len(t), device=t.device), t.clamp_min(0)] -= 1.0
            grad *= keep.unsqueeze(1).to(accumulate) / count
            grad_hidden[start : start + rows] = (grad.to(weight.dtype) @ weight).to(hidden.dtype)
            grad_weight += (grad.t() @ h.to(accumulate)).to(accumulate)
        ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype))
        return (total / count).to(torch.promote_types(hidden.dtype, torch.float32))

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_loss, grad_weight * grad_loss, None, None


class LMHead(nn.Linear):
    """The LM head: logits `[..., V]`, or, given `targets`, their mean cross-entropy
    without the logits (`linear_cross_entropy`). A module of its own, so engines that
    gather a module's parameters for its forward (FSDP, ZeRO-3) gather the weight."""

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if targets is None:
            return super().forward(x)
        assert self.bias is None, "the fused loss takes a head without bias"
        return linear_cross_entropy(x.flatten(0, -2), self.weight, targets.flatten())
