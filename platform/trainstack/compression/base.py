"""What every compressor shares: the payload, the `Compressor` interface, error feedback
and the per-step byte count.

A compression *bucket* here is one gradient tensor compressed as a unit. The DDP
hooks use one bucket per parameter, not DDP's multi-parameter buckets: DDP puts every
parameter in a single bucket on its first step and regroups them afterwards, so state
kept per DDP bucket would not survive a restart (see `hooks.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np
import torch

Aggregation = Literal["sum", "gather"]
"""How ranks combine payloads: `sum` (all-reduce the parts: decoding is linear in them)
or `gather` (all-gather every rank's parts and decode each)."""


@dataclass(frozen=True)
class Payload:
    """One compressed tensor: the parts that go on the wire, in a fixed order."""

    shape: torch.Size
    """Shape of the tensor it encodes."""
    parts: tuple[torch.Tensor, ...]
    """What is sent. Their sizes depend only on `shape`, so every rank's match."""

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def nbytes(self) -> int:
        return sum(part.numel() * part.element_size() for part in self.parts)


class Compressor(Protocol):
    """A lossy (or lossless) codec for one bucket at a time.

    `encode` may depend on `step` and `bucket_index` (seeded randomness, warm starts);
    `decode` gets the same two, so a receiver can regenerate what was not sent.
    """

    @property
    def aggregation(self) -> Aggregation:
        """How ranks combine this compressor's payloads."""
        ...

    def encode(self, tensor: torch.Tensor, *, step: int, bucket_index: int) -> Payload:
        """Compress `tensor` (any shape, float)."""
        ...

    def decode(self, payload: Payload, *, step: int, bucket_index: int) -> torch.Tensor:
        """An fp32 tensor of `payload.shape`."""
        ...

    def payload_bytes(self, shape: torch.Size) -> int:
        """Bytes `encode` puts on the wire for a tensor of `shape`."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """State `encode` carries between steps (e.g. warm starts); {} if none."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class StatelessCompressor:
    """Mixin for compressors whose encoding depends only on (input, step, bucket)."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state


class ErrorFeedback:
    """Per-rank residuals of lossy compression, by bucket index.

    Compresses g + e instead of g and keeps e <- g + e - decode(C(g + e)), so what a
    lossy compressor drops is sent later rather than lost. Disabled, it passes `g`
    through and keeps nothing.
    """

    def __init__(self, *, enabled: bool) -> None:
        self.enabled = enabled
        self.residuals: dict[int, torch.Tensor] = {}

    def corrected(self, tensor: torch.Tensor, bucket_index: int) -> torch.Tensor:
        """g + e as a new fp32 tensor (g itself, converted, when there is no residual)."""
        corrected = tensor.detach().to(torch.float32, copy=True)
        residual = self.residuals.get(bucket_index)
        if self.enabled and residual is not None:
            if residual.device != corrected.device:
                residual = self.residuals[bucket_index] = residual.to(corrected.device)
            corrected += residual.view_as(corrected)
        return corrected

    def update(self, bucket_index: int, corrected: torch.Tensor, decoded: torch.Tensor) -> None:
        """Keep corrected - decoded as the bucket's residual."""
        if self.enabled:
            self.residuals[bucket_index] = (corrected - decoded.view_as(corrected)).detach()

    def encode(
        self, compressor: Compressor, tensor: torch.Tensor, *, step: int, bucket_index: int
    ) -> Payload:
        """`compressor.encode(g + e)`, updating e."""
        corrected = self.corrected(tensor, bucket_index)
        payload = compressor.encode(corrected, step=step, bucket_index=bucket_index)
        if self.enabled:
            decoded = compressor.decode(payload, step=step, bucket_index=bucket_index)
            self.update(bucket_index, corrected, decoded)
        return payload

    def state_dict(self) -> dict[int, torch.Tensor]:
        return {index: e.detach().cpu().clone() for index, e in self.residuals.items()}

    def load_state_dict(self, residuals: dict[int, torch.Tensor]) -> None:
        self.residuals = {int(index): e.clone() for index, e in residuals.items()}


@dataclass(frozen=True)
class CommStats:
    """Bytes one rank passed to collectives during one optimizer step."""

    bytes_sent: int = 0
    """Sum of the sizes of the tensors this rank sent: its own contribution to an
    all-gather, the whole tensor of an all-reduce."""
    dense_bytes: int = 0
    """What plain DDP would have all-reduced: every gradient bucket in fp32."""
    gathered_bytes: int = 0
    """The part of `bytes_sent` that went to all-gathers (the rest to all-reduces)."""

    def __add__(self, other: CommStats) -> CommStats:
        return CommStats(
            bytes_sent=self.bytes_sent + other.bytes_sent,
            dense_bytes=self.dense_bytes + other.dense_bytes,
            gathered_bytes=self.gathered_bytes + other.gathered_bytes,
        )

    @property
    def ratio(self) -> float:
        """Compression ratio dense / sent (1.0 when nothing was sent)."""
        return self.dense_bytes / self.bytes_sent if self.bytes_sent else 1.0

    def wire_bytes(self, world_size: int) -> int:
        """Bytes this rank pushes through the network with ring collectives:
        2(N-1)/N of what it all-reduces plus (N-1) times what it all-gathers."""
        n, reduced = world_size, self.bytes_sent - self.gathered_bytes
        return 2 * (n - 1) * reduced // n + (n - 1) * self.gathered_bytes


def seeded_generator(*key: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator whose stream depends only on `key` (well mixed, any non-negative ints)."""
    words = np.random.SeedSequence(list(key)).generate_state(2, dtype=np.uint32)
    generator = torch.Generator(device=device)
    generator.manual_seed(int(words[0]) << 32 | int(words[1]))
    return generator
