"""DDP communication hooks that send gradients in compressed form.

DDP calls a hook once per DDP bucket on every backward that syncs (not inside
`no_sync`), in bucket order, the last one flagged `is_last()`; the hook leaves the
bucket holding the mean gradient over ranks. Ours split the bucket into its
parameters and treat each as a compression bucket, keyed by the parameter's index in
`model.parameters()`: DDP puts all parameters in one bucket on its first step and
regroups them after it, and per-parameter state (residuals, warm starts, random
streams) is the same however DDP groups them, on a fresh start and after a restart.
Tensors smaller than `min_numel` go dense: one fp32 all-reduce per DDP bucket.

Collectives run synchronously inside the hook (simple and correct on gloo and NCCL;
the price is less overlap with the backward pass than DDP's own asynchronous
all-reduce). Every byte handed to a collective is counted: the whole tensor of an
all-reduce, this rank's contribution to an all-gather.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations are the
# real `dist.GradBucket` and `Future[Tensor]` objects, not strings.

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainstack.compression.base import CommStats, Compressor, ErrorFeedback, Payload


@dataclass(frozen=True)
class GradUnit:
    """One parameter's gradient inside a DDP bucket: a compression bucket."""

    index: int
    """Position of the parameter in `model.parameters()`."""
    grad: torch.Tensor
    """View into the DDP bucket's buffer, in the parameter's shape."""


class BucketHook:
    """What our hooks share: per-parameter units, the step counter and the byte count.

    Subclasses implement `reduce`, which leaves each unit holding the mean over ranks.
    Register `communicate` with `DistributedDataParallel.register_comm_hook`.
    """

    def __init__(
        self, model: nn.Module, *, process_group: dist.ProcessGroup, min_numel: int
    ) -> None:
        self.param_index = {id(p): i for i, p in enumerate(model.parameters())}
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.min_numel = min_numel
        self.step = 0
        """Optimizer steps (synced backward passes) completed; seeds depend on it."""
        self.stats = CommStats()
        """Bytes of the last completed step."""
        self._sent = self._gathered = self._dense = 0

    def communicate(
        self, state: object, bucket: dist.GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        del state
        buffer = bucket.buffer()
        self.reduce(self._units(bucket))
        self._dense += buffer.numel() * buffer.element_size()
        if bucket.is_last():
            self.stats = CommStats(
                bytes_sent=self._sent, dense_bytes=self._dense, gathered_bytes=self._gathered
            )
            self._sent = self._gathered = self._dense = 0
            self.step += 1
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        future.set_result(buffer)
        return future

    def reduce(self, units: list[GradUnit]) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])

    def _units(self, bucket: dist.GradBucket) -> list[GradUnit]:
        buffer = bucket.buffer()
        units, offset = [], 0
        for param in bucket.parameters():
            view = buffer[offset : offset + param.numel()].view(param.shape)
            units.append(GradUnit(index=self.param_index[id(param)], grad=view))
            offset += param.numel()
        assert offset == buffer.numel(), "DDP bucket layout is not the parameters back to back"
        return units

    # ---- collectives (counted) ----

    def all_reduce_mean(self, grads: list[torch.Tensor]) -> None:
        """Average `grads` in place over ranks: one fp32 all-reduce of them all."""
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads]).div_(self.world_size)
        self.all_reduce(flat)
        for grad, mean in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            grad.copy_(mean.view_as(grad))

    def all_reduce(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor, group=self.process_group)
        self._sent += tensor.numel() * tensor.element_size()

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        gathered = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(gathered, tensor, group=self.process_group)
        self._sent += tensor.numel() * tensor.element_size()
        self._gathered += tensor.numel() * tensor.element_size()
        return gathered


class CodecHook(BucketHook):
    """Any `Compressor`, with error feedback: one collective per payload part per DDP bucket.

    `sum` compressors (random-k, casts): parts of all units are concatenated, divided
    by the world size and all-reduced; decoding the sums gives the mean. `gather`
    compressors (top-k, QSGD, sign): parts are all-gathered, every rank's payload
    decoded, and the decodings averaged.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        process_group: dist.ProcessGroup,
        compressor: Compressor,
        error_feedback: bool,
        min_numel: int,
    ) -> None:
        super().__init__(model, process_group=process_group, min_numel=min_numel)
        self.compressor = compressor
        self.feedback = ErrorFeedback(enabled=error_feedback)

    def reduce(self, units: list[GradUnit]) -> None:
        self.all_reduce_mean([u.grad for u in units if u.grad.numel() < self.min_numel])
        units = [u for u in units if u.grad.numel() >= self.min_numel]
        if not units:
            return
        payloads = [
            self.feedback.encode(self.compressor, u.grad, step=self.step, bucket_index=u.index)
            for u in units
        ]
        if self.compressor.aggregation == "sum":
            means = self._sum_and_decode(units, payloads)
        else:
            means = self._gather_and_decode(units, payloads)
        for unit, mean in zip(units, means, strict=True):
            unit.grad.copy_(mean)

    def _sum_and_decode(self, units: list[GradUnit], payloads: list[Payload]) -> list[torch.Tensor]:
        summed = [self._reduce_slot([p.parts[j] for p in payloads]) for j in _slots(payloads)]
        return [
            self.compressor.decode(
                Payload(payload.shape, tuple(slot[i] for slot in summed)),
                step=self.step,
                bucket_index=unit.index,
            )
            for i, (unit, payload) in enumerate(zip(units, payloads, strict=True))
        ]

    def _reduce_slot(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        flat = torch.cat([part.reshape(-1) for part in parts]).div_(self.world_size)
        self.all_reduce(flat)
        return _split_like(flat, parts)

    def _gather_and_decode(
        self, units: list[GradUnit], payloads: list[Payload]
    ) -> list[torch.Tensor]:
        # gathered[j][r][i]: part j of unit i as rank r sent it
        gathered = [self._gather_slot([p.parts[j] for p in payloads]) for j in _slots(payloads)]
        means = []
        for i, (unit, payload) in enumerate(zip(units, payloads, strict=True)):
            total = torch.zeros(payload.shape, dtype=torch.float32, device=unit.grad.device)
            for rank in range(self.world_size):
                parts = tuple(slot[rank][i] for slot in gathered)
                total += self.compressor.decode(
                    Payload(payload.shape, parts), step=self.step, bucket_index=unit.index
                )
            means.append(total.div_(self.world_size))
        return means

    def _gather_slot(self, parts: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        flat = torch.cat([part.reshape(-1) for part in parts])
        return [_split_like(theirs, parts) for theirs in self.all_gather(flat)]

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "residuals": self.feedback.state_dict(),
            "compressor": self.compressor.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.feedback.load_state_dict(state["residuals"])
        self.compressor.load_state_dict(state["compressor"])


def _slots(payloads: list[Payload]) -> range:
    return range(len(payloads[0].parts))


def _split_like(flat: torch.Tensor, parts: list[torch.Tensor]) -> list[torch.Tensor]:
    pieces = flat.split([part.numel() for part in parts])
    return [piece.view(part.shape) for piece, part in zip(pieces, parts, strict=True)]
