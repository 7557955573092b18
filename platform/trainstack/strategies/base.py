"""The Strategy interface: what the training loop may ask of a parallelism strategy.

A strategy turns (model, optimizer spec, worker context) into something that takes
a training step and saves/loads its state. The loop never calls DDP, DeepSpeed or
pipeline APIs itself: only the strategy does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from trainstack.checkpoint import Checkpoint

Batch = tuple[torch.Tensor, torch.Tensor]
"""One micro-batch: inputs [B, T] and next-token targets [B, T]."""


@dataclass(frozen=True, kw_only=True)
class WorkerContext:
    """Where this worker sits in the group; the same on Ray Train and plain torch.distributed."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


@dataclass(frozen=True, kw_only=True)
class StepOutput:
    """What one optimizer step produced on this rank."""

    loss: torch.Tensor
    """This rank's mean loss over its micro-batches (a 0-dim tensor, not synced)."""
    grad_norm: float
    """Global gradient norm before clipping."""
    lr: float
    """Learning rate used for this step."""


class Strategy(Protocol):
    """One parallelism technique behind the loop's four verbs."""

    name: str

    def setup(self, model: nn.Module) -> None:
        """Place and wrap the model; build optimizer and LR schedule."""

    def train_step(self, micro_batches: list[Batch]) -> StepOutput:
        """Forward/backward every micro-batch (accumulating), then one optimizer step."""

    def eval_loss(self, batches: list[Batch]) -> tuple[float, int]:
        """Sum of per-token losses and token count over `batches`, summed over the group."""

    def global_mean(self, value: torch.Tensor) -> float:
        """Mean of a per-rank scalar over the data-parallel group (a collective)."""

    def comm_bytes_per_step(self) -> int:
        """Bytes this rank sends per optimizer step (modelled from the algorithm)."""

    def unwrapped_model(self) -> nn.Module:
        """The bare model, for saving portable weights."""

    def checkpoint_files(self) -> dict[str, Any]:
        """Files this rank adds to a checkpoint: name -> torch-saveable object.

        Some rank must write `model.pt`, the full weights, so that any strategy and
        world size can load the checkpoint.
        """

    def load_checkpoint(self, checkpoint: Checkpoint) -> list[str]:
        """Restore from a verified checkpoint; return notes on what could not be restored."""


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every token of the micro-batch."""
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def ring_allreduce_bytes(numel: int, *, element_size: int, world_size: int) -> int:
    """Bytes one rank sends in a ring all-reduce of `numel` elements: 2(N-1)/N of the buffer."""
    if world_size == 1:
        return 0
    return 2 * (world_size - 1) * numel * element_size // world_size
