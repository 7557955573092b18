"""Gradient compression: codecs with error feedback, DDP hooks, bytes-on-wire accounting.

Every method sends less than the dense fp32 gradient (n coordinates, k = max(1,
ceil(ratio * n)); bytes per compressed tensor):

    fp16, bf16   2n                  all-reduce in 16-bit floats
    topk         8k                  all-gather (int32 index, fp32 value), sum
    randk        4k                  shared seeded indices; all-reduce the values
    qsgd         ceil(n*bits/8) + 4  all-gather packed codes + fp32 scale
    sign         ceil(n/8) + 4       all-gather packed signs + fp32 scale (mean |g|)
    powersgd     4(n + m)r           all-reduce P, then Q, of an n x m matrix

Tensors under `min_numel` (and, for powersgd, vectors or matrices not worth
factoring) go dense: 4n bytes. `CommStats` reports a step's bytes and its dense
equivalent; `modelled_comm_seconds` turns bytes into time.

What keeps accuracy: error feedback (`ErrorFeedback`), momentum correction (`local.py`:
each rank keeps the optimizer's moments and compresses the update), warm-up and local
clipping (the hooks). `kind: auto` (`auto.py`) picks top-k's ratio or dense from the
measured link and step times.

Use from DDP: `state = register_compression(ddp_model, cfg.compression,
world_size=..., seed=..., optim=cfg.optim)`, the optimizer built from
`compression.state.optimizer_config(cfg, world_size=...)`; then
`state.after_step(...)` and `state.stats` after each step, `state.state_dict()` /
`load_state_dict()` in checkpoints (per rank). As a codec
(parameter-server pushes): `build_compressor(cfg, seed=..., rank=...)` with
`ErrorFeedback(enabled=...).encode(compressor, g, step=..., bucket_index=...)`.
"""

from trainstack.compression.base import (
    CommStats,
    Compressor,
    ErrorFeedback,
    Payload,
    StatelessCompressor,
)
from trainstack.compression.bitpack import pack_bits, packed_bytes, unpack_bits
from trainstack.compression.cost import COLLECTIVES, modelled_comm_seconds
from trainstack.compression.hooks import BucketHook, CodecHook
from trainstack.compression.lowrank import LowRank, PowerSGDHook
from trainstack.compression.quantize import QSGD, Cast, Sign
from trainstack.compression.sparsify import RandK, TopK, sparse_k
from trainstack.compression.state import (
    CompressionState,
    build_compressor,
    register_compression,
)

__all__ = [
    "COLLECTIVES",
    "QSGD",
    "BucketHook",
    "Cast",
    "CodecHook",
    "CommStats",
    "CompressionState",
    "Compressor",
    "ErrorFeedback",
    "LowRank",
    "Payload",
    "PowerSGDHook",
    "RandK",
    "Sign",
    "StatelessCompressor",
    "TopK",
    "build_compressor",
    "modelled_comm_seconds",
    "pack_bits",
    "packed_bytes",
    "register_compression",
    "sparse_k",
    "unpack_bits",
]
