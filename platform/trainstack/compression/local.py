"""What each rank does to its own gradient before compressing it: Deep Gradient
Compression's local clipping and momentum correction (Lin et al., 2018), extended to
AdamW.

- Local clipping scales each tensor's gradient to at most `clip * sqrt(n_i / n)` in
  norm (n_i its elements, n the model's), so a rank's whole gradient stays within
  `clip` however its tensors share it.
- Momentum correction moves the optimizer's moments onto each rank and compresses the
  update they give instead of the gradient: SGD's u <- m u + g (DGC), AdamW's
  m̂ / (sqrt(v̂) + eps) from the rank's own first and second moments. What a
  sparsifier holds back then accumulates, through error feedback, in units of the
  update, and when it is sent it moves the weights as far as the steps it stood for
  would have. (Compressing raw gradients under AdamW loses that: Adam divides the
  accumulated burst by its own running scale, so a coordinate sent once in 100 steps
  moves a few steps' worth, not 100.) The optimizer then applies the averaged update
  with the learning rate and weight decay alone (`state.optimizer_config`). Under
  SGD, sparse kinds also zero u where they sent (momentum factor masking), so a
  coordinate's stale momentum does not push it again; AdamW's first moment is not
  masked (measured on the demo job, 1500 steps, top-k 1%: held-out loss 2.366
  unmasked, 2.390 masked).
"""

from __future__ import annotations

import math
from typing import Any

import torch


class LocalGradient:
    """Per-rank clipping and optimizer moments, by compression bucket (parameter index)."""

    def __init__(
        self,
        *,
        moments: str,
        momentum: float = 0.0,
        beta2: float = 0.0,
        eps: float = 1e-8,
        clip: float = 0.0,
        total_numel: int = 1,
    ) -> None:
        self.moments = moments
        """`none` (send the gradient), `sgd` (u <- m u + g) or `adamw`."""
        self.momentum = momentum
        """First-moment factor (SGD's momentum, AdamW's beta1)."""
        self.beta2 = beta2
        self.eps = eps
        self.clip = clip
        """Norm bound of the whole local gradient (0: no local clipping)."""
        self.total_numel = total_numel
        self.first: dict[int, torch.Tensor] = {}
        self.second: dict[int, torch.Tensor] = {}

    def prepare(self, grad: torch.Tensor, index: int, *, step: int) -> torch.Tensor:
        """What this rank compresses for `grad` at `step` (0-based): clipped, then its
        update. Callers must not modify the result."""
        return self.moments_of(self.clip_of(grad), index, step=step)

    def clip_of(self, grad: torch.Tensor) -> torch.Tensor:
        """`grad` clipped to its share of the bound (itself without clipping)."""
        if self.clip <= 0:
            return grad
        g = grad.detach().to(torch.float32, copy=True)
        limit = self.clip * math.sqrt(g.numel() / self.total_numel)
        return g.mul_(torch.clamp(limit / (g.norm() + 1e-6), max=1.0))

    def moments_of(self, g: torch.Tensor, index: int, *, step: int) -> torch.Tensor:
        """The update of gradient `g` from the bucket's moments, which it advances (`g`
        itself with no moments). Callers must not modify the result."""
        if self.moments == "none":
            return g
        g = g.detach().to(torch.float32)
        if self.moments == "sgd":
            u = self.first.get(index)
            self.first[index] = (
                g.clone() if u is None else u.to(g.device).mul_(self.momentum).add_(g)
            )
            return self.first[index]
        m = self.first.get(index, torch.zeros_like(g)).to(g.device)
        v = self.second.get(index, torch.zeros_like(g)).to(g.device)
        m.mul_(self.momentum).add_(g, alpha=1 - self.momentum)
        v.mul_(self.beta2).addcmul_(g, g, value=1 - self.beta2)
        self.first[index], self.second[index] = m, v
        t = step + 1
        denom = (v / (1 - self.beta2**t)).sqrt_().add_(self.eps)
        return (m / (1 - self.momentum**t)).div_(denom)

    def mask(self, index: int, sent: torch.Tensor) -> None:
        """Momentum factor masking (SGD's momentum only): forget the momentum of the
        coordinates sent."""
        u = self.first.get(index) if self.moments == "sgd" else None
        if u is not None:
            u.masked_fill_(sent.view_as(u), 0.0)

    def state_dict(self) -> dict[str, Any]:
        return {
            name: {i: t.detach().cpu().clone() for i, t in kept.items()}
            for name, kept in (("first", self.first), ("second", self.second))
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.first = {int(i): t.clone() for i, t in state.get("first", {}).items()}
        self.second = {int(i): t.clone() for i, t in state.get("second", {}).items()}
