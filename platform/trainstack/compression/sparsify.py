"""Sparsifiers: send k = max(1, ceil(ratio * n)) of a bucket's n coordinates.

- `TopK`: the k largest |g|, sent as (int32 indices, fp32 values): 8k bytes. Ranks
  pick different coordinates, so they all-gather and sum.
- `RandK`: k coordinates drawn from a generator seeded by (seed, step, bucket), the
  same on every rank, so only the k fp32 values travel (4k bytes) and an all-reduce
  sums them. Unbiased, the values are scaled by n / k (1 / ratio up to rounding k);
  under error feedback they are sent unscaled, because scaled random-k makes the
  residual grow: E|g - C(g)|² = (n/k - 1)|g|².
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import ClassVar

import torch

from trainstack.compression.base import Aggregation, Payload, StatelessCompressor, seeded_generator


def sparse_k(numel: int, ratio: float) -> int:
    """Coordinates kept of `numel`: max(1, ceil(ratio * numel)), at most `numel`.

    `ratio` is read as the decimal it was written as, so 0.07 * 100 keeps 7, not 8.
    """
    return min(numel, max(1, math.ceil(Fraction(repr(ratio)) * numel)))


def warmup_ratio(ratio: float, *, step: int, warmup_steps: int) -> float:
    """Deep Gradient Compression's sparsity warm-up: the ratio falls exponentially from
    1 at step 0 to `ratio` at `warmup_steps` (ratio ** (step / warmup_steps))."""
    if step >= warmup_steps:
        return ratio
    return float(ratio ** (step / warmup_steps))


@dataclass
class TopK(StatelessCompressor):
    ratio: float
    aggregation: ClassVar[Aggregation] = "gather"

    def encode(self, tensor: torch.Tensor, *, step: int, bucket_index: int) -> Payload:
        flat = tensor.detach().reshape(-1).to(torch.float32)
        k = sparse_k(flat.numel(), self.ratio)
        indices = flat.abs().topk(k, sorted=False).indices
        return Payload(tensor.shape, (indices.to(torch.int32), flat[indices]))

    def decode(self, payload: Payload, *, step: int, bucket_index: int) -> torch.Tensor:
        indices, values = payload.parts
        dense = torch.zeros(payload.numel, dtype=torch.float32, device=values.device)
        dense.index_put_((indices.long(),), values.float(), accumulate=True)
        return dense.view(payload.shape)

    def payload_bytes(self, shape: torch.Size) -> int:
        return 8 * sparse_k(shape.numel(), self.ratio)


@dataclass
class RandK(StatelessCompressor):
    ratio: float
    seed: int
    unbiased: bool = True
    """Scale values by n / k; off under error feedback (see the module docstring)."""
    aggregation: ClassVar[Aggregation] = "sum"

    def indices(self, numel: int, *, step: int, bucket_index: int) -> torch.Tensor:
        """The bucket's k coordinates at `step`: the same on every rank (CPU, sorted)."""
        generator = seeded_generator(self.seed, step, bucket_index)
        chosen = torch.randperm(numel, generator=generator)[: sparse_k(numel, self.ratio)]
        return chosen.sort().values

    def encode(self, tensor: torch.Tensor, *, step: int, bucket_index: int) -> Payload:
        flat = tensor.detach().reshape(-1).to(torch.float32)
        indices = self.indices(flat.numel(), step=step, bucket_index=bucket_index)
        return Payload(tensor.shape, (flat[indices.to(flat.device)],))

    def decode(self, payload: Payload, *, step: int, bucket_index: int) -> torch.Tensor:
        (values,) = payload.parts
        indices = self.indices(payload.numel, step=step, bucket_index=bucket_index)
        scale = payload.numel / indices.numel() if self.unbiased else 1.0
        dense = torch.zeros(payload.numel, dtype=torch.float32, device=values.device)
        dense[indices.to(values.device)] = values.float() * scale
        return dense.view(payload.shape)

    def payload_bytes(self, shape: torch.Size) -> int:
        return 4 * sparse_k(shape.numel(), self.ratio)
