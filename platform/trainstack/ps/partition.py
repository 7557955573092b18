"""Which parameters each parameter-server shard holds, and their flat wire format.

Parameters (each tensor once: the GPT's tied LM head is its token embedding) are
dealt to S shards largest first, each to the shard holding the fewest bytes so far,
so shards stay balanced by bytes. A shard's parameters travel as one flat float32
numpy array in a fixed order: a pull or push is one buffer in Ray's object store,
not a pickled list of tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from trainstack.config import ConfigError, JobConfig


@dataclass(frozen=True, kw_only=True)
class ShardLayout:
    """The parameters of one shard: names, shapes, and where each sits in the flat buffer."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    @property
    def sizes(self) -> list[int]:
        return [int(np.prod(shape)) for shape in self.shapes]

    @property
    def numel(self) -> int:
        return sum(self.sizes)

    def flatten(self, tensors: Mapping[str, torch.Tensor]) -> np.ndarray:
        """This shard's entries of `tensors` as one float32 array."""
        parts = [tensors[name].detach().reshape(-1).to(torch.float32) for name in self.names]
        return torch.cat(parts).numpy()

    def unflatten(self, flat: np.ndarray) -> dict[str, torch.Tensor]:
        """Name -> tensor views of `flat` (copied, so the buffer may be read-only)."""
        out, offset = {}, 0
        data = torch.from_numpy(np.array(flat, dtype=np.float32, copy=True))
        for name, shape, size in zip(self.names, self.shapes, self.sizes, strict=True):
            out[name] = data[offset : offset + size].view(shape)
            offset += size
        return out


def partition(model: nn.Module, num_shards: int) -> list[ShardLayout]:
    """Greedy largest-first split of `model`'s parameters over `num_shards` shards."""
    params = list(model.named_parameters())  # each shared tensor once, under its first name
    assert 1 <= num_shards <= len(params), "config validation bounds num_shards"
    load = [0] * num_shards
    members: list[list[tuple[str, tuple[int, ...]]]] = [[] for _ in range(num_shards)]
    for name, p in sorted(params, key=lambda item: -item[1].numel()):
        target = min(range(num_shards), key=lambda i: (load[i], i))
        load[target] += p.numel() * 4
        members[target].append((name, tuple(p.shape)))
    order = {name: i for i, (name, _) in enumerate(params)}
    layouts = []
    for group in members:
        group.sort(key=lambda item: order[item[0]])  # model order inside a shard
        layouts.append(
            ShardLayout(
                names=tuple(name for name, _ in group),
                shapes=tuple(shape for _, shape in group),
            )
        )
    return layouts


def check_shards(cfg: JobConfig, model: nn.Module) -> None:
    """A parameter-server shard holds at least one parameter tensor."""
    tensors = len(list(model.parameters()))
    shards = cfg.strategy.num_shards
    if shards > tensors:
        raise ConfigError(
            f"strategy.num_shards={shards} is more than the model's {tensors} parameter "
            f"tensors; allowed: 1 to {tensors}"
        )
