"""Time on the wire, from the α-β model, for what the compressors send."""

from __future__ import annotations

from typing import Literal

Collective = Literal["all_reduce", "all_gather"]

COLLECTIVES: dict[str, Collective] = {
    "none": "all_reduce",
    "fp16": "all_reduce",
    "bf16": "all_reduce",
    "randk": "all_reduce",
    "powersgd": "all_reduce",
    "topk": "all_gather",
    "auto": "all_gather",
    "qsgd": "all_gather",
    "sign": "all_gather",
}
"""The collective each compression kind uses for its compressed tensors."""


def modelled_comm_seconds(
    *,
    kind: Collective,
    bytes_per_rank: float,
    world_size: int,
    bandwidth_gbit: float,
    latency_s: float,
) -> float:
    """Seconds a ring collective takes under the α-β model.

    With N = world_size, α = latency_s and β = bandwidth_gbit * 1e9 / 8 bytes/s:
      ring all-reduce of a tensor of `bytes_per_rank`:  2(N-1)·α + 2(N-1)/N · bytes/β
      ring all-gather of `bytes_per_rank` from each rank: (N-1)·α + (N-1) · bytes/β
    One rank (N = 1) sends nothing: 0 s.
    """
    n = world_size
    beta = bandwidth_gbit * 1e9 / 8
    if kind == "all_reduce":
        return 2 * (n - 1) * latency_s + 2 * (n - 1) / n * bytes_per_rank / beta
    return (n - 1) * latency_s + (n - 1) * bytes_per_rank / beta
