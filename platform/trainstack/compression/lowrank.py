"""PowerSGD (Vogels et al., 2019): a rank-r approximation by one step of power iteration.

A gradient of shape (n, ...) is viewed as an n x m matrix M. With Q (m x r) kept from
the previous step (warm start; a seeded Gaussian at first, the same on every rank):

    P = mean_ranks(M Q);  P <- orthonormal(P);  Q = mean_ranks(M^T P);  M ~ P Q^T

so each rank sends 4(n + m)r bytes instead of 4nm, in two all-reduces. A matrix is
compressed only when that is smaller ((n + m) r < n m, with r = min(n, m, rank)) and
it has at least `min_numel` elements; vectors and small tensors go dense.

Why not torch's `powerSGD_hook`: it keys residuals and warm starts by DDP bucket and
must stay dense for the first two steps, because DDP regroups its buckets after the
first; after a restart DDP regroups again, and the saved state would no longer fit.
Here the state is per parameter, so compression starts at step 1 and resumes exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from trainstack.compression.base import Aggregation, ErrorFeedback, Payload, seeded_generator
from trainstack.compression.hooks import BucketHook, Done, GradUnit
from trainstack.compression.local import LocalGradient


def low_rank_shape(shape: torch.Size, rank: int) -> tuple[int, int, int] | None:
    """(n, m, r) when a tensor of `shape` is worth sending as rank-r factors, else None."""
    if len(shape) < 2:
        return None
    n = shape[0]
    m = shape.numel() // n
    r = min(n, m, rank)
    return (n, m, r) if (n + m) * r < n * m else None


def orthonormal(p: torch.Tensor) -> torch.Tensor:
    """Orthonormal basis of p's columns (reduced QR; stable for rank-deficient p)."""
    return torch.linalg.qr(p, mode="reduced").Q


def initial_q(
    m: int, r: int, *, seed: int, bucket_index: int, device: torch.device
) -> torch.Tensor:
    """The first Q of a bucket: Gaussian, drawn on CPU so every rank and device agree."""
    generator = seeded_generator(seed, bucket_index)
    return torch.randn(m, r, generator=generator).to(device)


@dataclass
class LowRank:
    """PowerSGD as a codec, one sender at a time (for parameter-server pushes).

    encode: P = orthonormal(M Q), Q = M^T P, payload (P, Q); decode: P Q^T. Tensors
    not worth factoring travel as fp32.
    """

    approx_rank: int
    seed: int
    warm_start: dict[int, torch.Tensor] = field(default_factory=dict)
    """Last Q per bucket."""
    aggregation: ClassVar[Aggregation] = "gather"

    def encode(self, tensor: torch.Tensor, *, step: int, bucket_index: int) -> Payload:
        dims = low_rank_shape(tensor.shape, self.approx_rank)
        if dims is None:
            return Payload(tensor.shape, (tensor.detach().reshape(-1).to(torch.float32),))
        n, m, r = dims
        matrix = tensor.detach().reshape(n, m).to(torch.float32)
        q = self.warm_start.get(bucket_index)
        if q is None:
            q = initial_q(m, r, seed=self.seed, bucket_index=bucket_index, device=matrix.device)
        p = orthonormal(matrix @ q.to(matrix.device))
        q = matrix.T @ p
        self.warm_start[bucket_index] = q
        return Payload(tensor.shape, (p.reshape(-1), q.reshape(-1)))

    def decode(self, payload: Payload, *, step: int, bucket_index: int) -> torch.Tensor:
        if len(payload.parts) == 1:
            return payload.parts[0].to(torch.float32).view(payload.shape)
        dims = low_rank_shape(payload.shape, self.approx_rank)
        assert dims is not None, payload.shape
        n, m, r = dims
        p, q = payload.parts
        return (p.view(n, r) @ q.view(m, r).T).view(payload.shape)

    def payload_bytes(self, shape: torch.Size) -> int:
        dims = low_rank_shape(shape, self.approx_rank)
        return 4 * shape.numel() if dims is None else 4 * (dims[0] + dims[1]) * dims[2]

    def state_dict(self) -> dict[str, Any]:
        return {"warm_start": {i: q.cpu().clone() for i, q in self.warm_start.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.warm_start = {int(i): q.clone() for i, q in state["warm_start"].items()}


class PowerSGDHook(BucketHook):
    """PowerSGD over DDP: per DDP bucket, one all-reduce for all P, one for all Q."""

    def __init__(
        self,
        model: nn.Module,
        *,
        process_group: dist.ProcessGroup,
        approx_rank: int,
        seed: int,
        error_feedback: bool,
        min_numel: int,
        warmup_steps: int = 0,
        local: LocalGradient | None = None,
    ) -> None:
        super().__init__(
            model,
            process_group=process_group,
            min_numel=min_numel,
            warmup_steps=warmup_steps,
            local=local,
        )
        self.approx_rank = approx_rank
        self.seed = seed
        self.feedback = ErrorFeedback(enabled=error_feedback)
        self.warm_start: dict[int, torch.Tensor] = {}
        """Last all-reduced Q per parameter: identical on every rank."""

    def _dims(self, shape: torch.Size) -> tuple[int, int, int] | None:
        return low_rank_shape(shape, self.approx_rank) if shape.numel() >= self.min_numel else None

    def reduce(self, units: list[GradUnit]) -> Done:
        """P's all-reduce must finish before Q can be computed, so only Q's overlaps the
        rest of the backward pass."""
        dense, units, sent = self.split_dense(
            units, lambda u: self.warming_up or self._dims(u.grad.shape) is None
        )
        if not units:
            return dense
        # every unit left has dims: the rest went dense
        dims = [d for d in (self._dims(u.grad.shape) for u in units) if d is not None]
        matrices = [
            self.feedback.corrected(x, u.index).view(n, m)
            for u, x, (n, m, _) in zip(units, sent, dims, strict=True)
        ]
        qs = [
            self._warm_q(u.index, m, r, device=u.grad.device)
            for u, (_, m, r) in zip(units, dims, strict=True)
        ]
        ps, reduced = self._mean([matrix @ q for matrix, q in zip(matrices, qs, strict=True)])
        reduced.wait()
        ps = [orthonormal(p) for p in ps]
        qs, reduced = self._mean([matrix.T @ p for matrix, p in zip(matrices, ps, strict=True)])

        def write() -> None:
            for unit, matrix, p, q in zip(units, matrices, ps, qs, strict=True):
                approx = p @ q.T
                self.feedback.update(unit.index, matrix, approx)
                self.warm_start[unit.index] = q
                unit.grad.copy_(approx.view_as(unit.grad))

        return self.after([dense, reduced], write)

    def _warm_q(self, index: int, m: int, r: int, *, device: torch.device) -> torch.Tensor:
        q = self.warm_start.get(index)
        if q is None:
            return initial_q(m, r, seed=self.seed, bucket_index=index, device=device)
        return q.to(device)

    def _mean(
        self, factors: list[torch.Tensor]
    ) -> tuple[list[torch.Tensor], torch.futures.Future[Any]]:
        """Launch the mean over ranks of `factors`: views of it, and its future."""
        flat = torch.cat([f.reshape(-1) for f in factors]).div_(self.world_size)
        launched = self.all_reduce(flat)
        pieces = flat.split([f.numel() for f in factors])
        return [piece.view_as(f) for piece, f in zip(pieces, factors, strict=True)], launched

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "residuals": self.feedback.state_dict(),
            "warm_start": {i: q.cpu().clone() for i, q in self.warm_start.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.feedback.load_state_dict(state["residuals"])
        self.warm_start = {int(i): q.clone() for i, q in state["warm_start"].items()}
