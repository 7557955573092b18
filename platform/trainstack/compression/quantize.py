"""Quantizers: fewer bits per coordinate, every coordinate sent.

- `Cast` (fp16, bf16): round to a 16-bit float; 2n bytes; ranks all-reduce in it.
- `QSGD` (b bits): scale s = max|g| per bucket and L = 2**(b-1) - 1 levels per sign;
  each coordinate becomes floor(g/s * L + u), u ~ U[0, 1), an integer in [-L, L], so
  E[decode] = g (unbiased) and zeros stay zero. Codes (level + L) are packed b bits
  each: ceil(n*b/8) + 4 bytes with the fp32 scale. Ranks all-gather and average.
- `Sign` (EF-signSGD, 1 bit): sign(g) with the scale mean|g|, packed 8 per byte
  (g >= 0 is sent as +): ceil(n/8) + 4 bytes. Biased; meant for error feedback.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from trainstack.compression.base import Aggregation, Payload, StatelessCompressor, seeded_generator
from trainstack.compression.bitpack import pack_bits, packed_bytes, unpack_bits


@dataclass
class Cast(StatelessCompressor):
    dtype: torch.dtype
    aggregation: ClassVar[Aggregation] = "sum"

    def encode(self, tensor: torch.Tensor, *, step: int, bucket_index: int) -> Payload:
        return Payload(tensor.shape, (tensor.detach().reshape(-1).to(self.dtype),))

    def decode(self, payload: Payload, *, step: int, bucket_index: int) -> torch.Tensor:
        return payload.parts[0].to(torch.float32).view(payload.shape)

    def payload_bytes(self, shape: torch.Size) -> int:
        return shape.numel() * self.dtype.itemsize


@dataclass
class QSGD(StatelessCompressor):
    bits: int
    seed: int
    rank: int = 0
    """Whose rounding noise: ranks draw independent noise."""
    aggregation: ClassVar[Aggregation] = "gather"

    @property
    def levels(self) -> int:
        """L: nonzero levels per sign."""
        return 2 ** (self.bits - 1) - 1

    def encode(self, tensor: torch.Tensor, *, step: int, bucket_index: int) -> Payload:
        flat = tensor.detach().reshape(-1).to(torch.float32)
        scale = flat.abs().max() if flat.numel() else flat.new_zeros(())
        per_unit = torch.where(scale > 0, self.levels / scale, 0.0)
        generator = seeded_generator(self.seed, self.rank, step, bucket_index, device=flat.device)
        noise = torch.rand(flat.numel(), generator=generator, device=flat.device)
        level = torch.floor(flat * per_unit + noise).clamp_(-self.levels, self.levels)
        codes = (level + self.levels).to(torch.uint8)
        return Payload(tensor.shape, (pack_bits(codes, self.bits), scale.reshape(1)))

    def decode(self, payload: Payload, *, step: int, bucket_index: int) -> torch.Tensor:
        packed, scale = payload.parts
        codes = unpack_bits(packed, self.bits, payload.numel).to(torch.float32)
        return ((codes - self.levels) * (scale / self.levels)).view(payload.shape)

    def payload_bytes(self, shape: torch.Size) -> int:
        return packed_bytes(shape.numel(), self.bits) + 4


@dataclass
class Sign(StatelessCompressor):
    aggregation: ClassVar[Aggregation] = "gather"

    def encode(self, tensor: torch.Tensor, *, step: int, bucket_index: int) -> Payload:
        flat = tensor.detach().reshape(-1).to(torch.float32)
        scale = flat.abs().mean() if flat.numel() else flat.new_zeros(())
        return Payload(tensor.shape, (pack_bits(flat >= 0, 1), scale.reshape(1)))

    def decode(self, payload: Payload, *, step: int, bucket_index: int) -> torch.Tensor:
        packed, scale = payload.parts
        signs = unpack_bits(packed, 1, payload.numel).to(torch.float32) * 2 - 1
        return (signs * scale).view(payload.shape)

    def payload_bytes(self, shape: torch.Size) -> int:
        return packed_bytes(shape.numel(), 1) + 4
