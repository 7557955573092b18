"""Packing small unsigned codes into bytes: 8, 4, 2 or 1 code(s) per byte.

Code i of the input lands in byte i // (8 // bits), at bit offset (i % (8 // bits)) * bits
(lowest bits first). The last byte is zero-padded, so n codes take ceil(n * bits / 8)
bytes.
"""

from __future__ import annotations

import torch

PACKABLE_BITS: tuple[int, ...] = (1, 2, 4, 8)


def packed_bytes(numel: int, bits: int) -> int:
    """Bytes that `numel` codes of `bits` bits take once packed."""
    return -(-numel * bits // 8)


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Flat uint8 codes, each < 2**bits, -> uint8 tensor of `packed_bytes(n, bits)`."""
    assert bits in PACKABLE_BITS, bits
    codes = codes.reshape(-1).to(torch.uint8)
    if bits == 8:
        return codes.clone()
    per_byte = 8 // bits
    padded = torch.zeros(
        packed_bytes(codes.numel(), bits) * per_byte, dtype=torch.uint8, device=codes.device
    )
    padded[: codes.numel()] = codes
    shifts = _shifts(bits, codes.device)
    fields = padded.view(-1, per_byte) << shifts  # disjoint bit fields: their sum is their OR
    return fields.sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of `pack_bits`: the first `numel` codes, as a flat uint8 tensor."""
    assert bits in PACKABLE_BITS, bits
    if bits == 8:
        return packed[:numel].clone()
    mask = (1 << bits) - 1
    codes = (packed.unsqueeze(1) >> _shifts(bits, packed.device)) & mask
    return codes.reshape(-1)[:numel]


def _shifts(bits: int, device: torch.device) -> torch.Tensor:
    return torch.arange(0, 8, bits, dtype=torch.uint8, device=device)
