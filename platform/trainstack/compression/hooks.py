"""DDP communication hooks that send gradients in compressed form.

DDP calls a hook once per DDP bucket on every backward that syncs (not inside
`no_sync`), in bucket order, the last one flagged `is_last()`; the hook leaves the
bucket holding the mean gradient over ranks. Ours split the bucket into its
parameters and treat each as a compression bucket, keyed by the parameter's index in
`model.parameters()`: DDP puts all parameters in one bucket on its first step and
regroups them after it, and per-parameter state (residuals, warm starts, random
streams) is the same however DDP groups them, on a fresh start and after a restart.
Tensors smaller than `min_numel` go dense: one fp32 all-reduce per DDP bucket.

Hooks encode on the calling thread (residuals and the compressed tensors' moments
change there, in bucket order) and launch their collectives asynchronously; decoding
the received parts into the bucket (and the dense tensors' moments, advanced from the
mean) is a callback on the collective's future. So, as with DDP's
own all-reduce, communication and decoding overlap the rest of the backward pass.
Every byte handed to a collective is counted: the whole tensor of an all-reduce, this
rank's contribution to an all-gather.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations are the
# real `dist.GradBucket` and `Future[Tensor]` objects, not strings.

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainstack.compression.auto import AdaptiveRatio
from trainstack.compression.base import CommStats, Compressor, ErrorFeedback, Payload
from trainstack.compression.local import LocalGradient
from trainstack.compression.sparsify import RandK, TopK, warmup_ratio

Done = torch.futures.Future[None]
"""Completes when a hook's units hold the mean over ranks."""


def done() -> Done:
    """A `Done` that has completed."""
    future: Done = torch.futures.Future()
    future.set_result(None)
    return future


def when_all(futures: list[torch.futures.Future[Any]], then: Callable[[], None]) -> Done:
    """Run `then` once every future has completed (at once if there are none)."""
    if not futures:
        then()
        return done()

    def finish(all_done: torch.futures.Future[Any]) -> None:
        for future in all_done.value():
            future.value()  # re-raise a failed collective
        then()

    return torch.futures.collect_all(futures).then(finish)


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
        self,
        model: nn.Module,
        *,
        process_group: dist.ProcessGroup,
        min_numel: int,
        warmup_steps: int = 0,
        local: LocalGradient | None = None,
    ) -> None:
        self.param_index = {id(p): i for i, p in enumerate(model.parameters())}
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.min_numel = min_numel
        self.warmup_steps = warmup_steps
        """Compression warm-up: steps over which compression ramps in (0: none)."""
        self.local = local or LocalGradient(moments="none")
        """Local clipping and momentum correction, applied to every gradient first."""
        self.step = 0
        """Optimizer steps (synced backward passes) completed; seeds depend on it."""
        self.stats = CommStats()
        """Bytes of the last completed step."""
        self.total = CommStats()
        """Bytes of every step so far (warm-up included), over restarts."""
        self.codec_seconds = 0.0
        """Seconds spent encoding, launching and decoding in this process (both threads)."""
        self.first_step = 0
        """The step this process started from (codec_seconds covers the steps since)."""
        self._sent = self._gathered = self._dense = 0

    def communicate(
        self, state: object, bucket: dist.GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        del state
        buffer = bucket.buffer()
        start = time.perf_counter()
        reduced = self.reduce(self._units(bucket))
        self.codec_seconds += time.perf_counter() - start
        self._dense += buffer.numel() * buffer.element_size()
        if bucket.is_last():
            self.stats = CommStats(
                bytes_sent=self._sent, dense_bytes=self._dense, gathered_bytes=self._gathered
            )
            self.total = self.total + self.stats
            self._sent = self._gathered = self._dense = 0
            self.step += 1
        return reduced.then(lambda _: buffer)

    def reduce(self, units: list[GradUnit]) -> Done:
        """Launch what leaves each unit holding the mean over ranks."""
        raise NotImplementedError

    def take_residual(self, index: int) -> torch.Tensor | None:
        """The residual a unit kept from compressed steps, now to be sent dense (and
        forgotten); None if it has none."""
        del index
        return None

    def after(self, futures: list[torch.futures.Future[Any]], then: Callable[[], None]) -> Done:
        """Run `then` (decoding: timed as codec work) once every future has completed."""

        def timed() -> None:
            start = time.perf_counter()
            then()
            self.codec_seconds += time.perf_counter() - start

        return when_all(futures, timed)

    @property
    def codec_seconds_per_step(self) -> float:
        """Mean seconds of codec work per step in this process (0 before a step)."""
        steps = self.step - self.first_step
        return self.codec_seconds / steps if steps else 0.0

    @property
    def warming_up(self) -> bool:
        return self.step < self.warmup_steps

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "local": self.local.state_dict(),
            "total": dataclasses.asdict(self.total),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = self.first_step = int(state["step"])
        self.local.load_state_dict(state.get("local", {}))
        self.total = CommStats(**state.get("total", {}))

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

    def all_reduce_mean(self, units: list[GradUnit]) -> Done:
        """Send `units` dense: one fp32 all-reduce of their (clipped) gradients, then
        each unit's update from the mean: every rank advances the same moments from
        the averaged gradient, so dense tensors train as under plain DDP. A residual
        left by compressed steps (auto turned dense) is averaged along and added."""
        if not units:
            return done()
        step = self.step
        grads = [self.local.clip_of(u.grad) for u in units]
        residuals = [self.take_residual(u.index) for u in units]
        parts = grads + [r for r in residuals if r is not None]
        flat = torch.cat([t.reshape(-1).to(torch.float32) for t in parts]).div_(self.world_size)

        def write() -> None:
            means = iter(flat.split([t.numel() for t in parts]))
            for unit in units:
                mean = next(means).view_as(unit.grad)
                update = self.local.moments_of(mean, unit.index, step=step)
                unit.grad.copy_(update)
            for unit, residual in zip(units, residuals, strict=True):
                if residual is not None:
                    unit.grad.add_(next(means).view_as(unit.grad))

        return self.after([self.all_reduce(flat)], write)

    def split_dense(
        self, units: list[GradUnit], dense: Callable[[GradUnit], bool]
    ) -> tuple[Done, list[GradUnit], list[torch.Tensor]]:
        """All-reduce the units `dense` picks; return that reduction, the other units
        and what each of them is to compress (clipped, its rank's update)."""
        picked = [dense(u) for u in units]
        reduced = self.all_reduce_mean([u for u, d in zip(units, picked, strict=True) if d])
        rest = [u for u, d in zip(units, picked, strict=True) if not d]
        sent = [self.local.prepare(u.grad, u.index, step=self.step) for u in rest]
        return reduced, rest, sent

    def all_reduce(self, tensor: torch.Tensor) -> torch.futures.Future[Any]:
        """Launch a sum of `tensor` over ranks, in place."""
        work = dist.all_reduce(tensor, group=self.process_group, async_op=True)
        self._sent += tensor.numel() * tensor.element_size()
        return work.get_future()

    def all_gather(
        self, tensor: torch.Tensor
    ) -> tuple[list[torch.Tensor], torch.futures.Future[Any]]:
        """Launch a gather of every rank's `tensor` into the returned list."""
        gathered = [torch.empty_like(tensor) for _ in range(self.world_size)]
        work = dist.all_gather(gathered, tensor, group=self.process_group, async_op=True)
        self._sent += tensor.numel() * tensor.element_size()
        self._gathered += tensor.numel() * tensor.element_size()
        return gathered, work.get_future()


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
        warmup_steps: int = 0,
        local: LocalGradient | None = None,
        adaptive: AdaptiveRatio | None = None,
    ) -> None:
        super().__init__(
            model,
            process_group=process_group,
            min_numel=min_numel,
            warmup_steps=warmup_steps,
            local=local,
        )
        self.adaptive = adaptive
        """`compression.kind: auto`: the top-k ratio (1: dense) it chooses per step."""
        self.compressor = compressor
        """The codec at its configured ratio (warm-up lowers a sparsifier's per step)."""
        self.sparse = isinstance(compressor, TopK | RandK)
        self.feedback = ErrorFeedback(enabled=error_feedback)

    def reduce(self, units: list[GradUnit]) -> Done:
        compressor = self._current_compressor()
        dense_now = (self.warming_up and not self.sparse) or (
            self.adaptive is not None and self.adaptive.ratio >= 1.0
        )
        dense, units, sent = self.split_dense(
            units, lambda u: dense_now or u.grad.numel() < self.min_numel
        )
        if not units:
            return dense
        payloads = [self._encode(compressor, u, x) for u, x in zip(units, sent, strict=True)]
        codec = Codec(compressor, self.step, self.world_size)
        slots = range(len(payloads[0].parts))
        if compressor.aggregation == "sum":
            flats = [codec.flat_slot([p.parts[j] for p in payloads]) for j in slots]
            launched = [self.all_reduce(flat) for flat in flats]
            return self.after([dense, *launched], lambda: codec.write_sums(units, payloads, flats))
        gathers = [
            self.all_gather(torch.cat([p.parts[j].reshape(-1) for p in payloads])) for j in slots
        ]
        received = [gathered for gathered, _ in gathers]
        return self.after(
            [dense, *(future for _, future in gathers)],
            lambda: codec.write_gathered(units, payloads, received),
        )

    def _current_compressor(self) -> Compressor:
        """Sparsifiers under warm-up keep a ratio ramping from 1 to theirs; under auto,
        the controller's."""
        base = self.compressor
        if not isinstance(base, TopK | RandK):
            return base
        if self.adaptive is not None:
            return dataclasses.replace(base, ratio=self.adaptive.ratio)
        if not self.warming_up:
            return base
        ratio = warmup_ratio(base.ratio, step=self.step, warmup_steps=self.warmup_steps)
        return dataclasses.replace(base, ratio=ratio)

    def take_residual(self, index: int) -> torch.Tensor | None:
        return self.feedback.residuals.pop(index, None)

    def _encode(self, compressor: Compressor, unit: GradUnit, sent: torch.Tensor) -> Payload:
        """Compress sent + residual; keep the new residual; mask momentum where sent."""
        corrected = self.feedback.corrected(sent, unit.index)
        step, index = self.step, unit.index
        payload = compressor.encode(corrected, step=step, bucket_index=index)
        masking = self.sparse and self.local.moments == "sgd"
        if self.feedback.enabled or masking:
            decoded = compressor.decode(payload, step=step, bucket_index=index)
            self.feedback.update(index, corrected, decoded)
            if masking:
                self.local.mask(index, decoded != 0)
        return payload

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "residuals": self.feedback.state_dict(),
            "compressor": self.compressor.state_dict(),
            "adaptive": self.adaptive.state_dict() if self.adaptive is not None else {},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.feedback.load_state_dict(state["residuals"])
        self.compressor.load_state_dict(state["compressor"])
        if self.adaptive is not None and state.get("adaptive"):
            self.adaptive.load_state_dict(state["adaptive"])


@dataclass(frozen=True)
class Codec:
    """Decoding one step's received parts into the units (runs in a future's callback,
    so it holds the compressor and step of the launch, not the hook's current ones)."""

    compressor: Compressor
    step: int
    world_size: int

    def flat_slot(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """One payload slot of every unit, concatenated and divided by the world size."""
        return torch.cat([part.reshape(-1) for part in parts]).div_(self.world_size)

    def write_sums(
        self, units: list[GradUnit], payloads: list[Payload], flats: list[torch.Tensor]
    ) -> None:
        """`sum` compressors: decode each unit's summed parts (the mean, decoding being
        linear in them)."""
        summed = [_split_like(flat, [p.parts[j] for p in payloads]) for j, flat in enumerate(flats)]
        for i, (unit, payload) in enumerate(zip(units, payloads, strict=True)):
            parts = tuple(slot[i] for slot in summed)
            unit.grad.copy_(self._decode(unit, Payload(payload.shape, parts)))

    def write_gathered(
        self,
        units: list[GradUnit],
        payloads: list[Payload],
        received: list[list[torch.Tensor]],
    ) -> None:
        """`gather` compressors: decode every rank's payload of each unit and average.
        received[j][r]: slot j of all units as rank r sent it."""
        # split[j][r][i]: part j of unit i as rank r sent it
        split = [
            [_split_like(theirs, [p.parts[j] for p in payloads]) for theirs in slot]
            for j, slot in enumerate(received)
        ]
        for i, (unit, payload) in enumerate(zip(units, payloads, strict=True)):
            total = torch.zeros(payload.shape, dtype=torch.float32, device=unit.grad.device)
            for rank in range(self.world_size):
                parts = tuple(slot[rank][i] for slot in split)
                total += self._decode(unit, Payload(payload.shape, parts))
            unit.grad.copy_(total.div_(self.world_size))

    def _decode(self, unit: GradUnit, payload: Payload) -> torch.Tensor:
        return self.compressor.decode(payload, step=self.step, bucket_index=unit.index)


def _split_like(flat: torch.Tensor, parts: list[torch.Tensor]) -> list[torch.Tensor]:
    pieces = flat.split([part.numel() for part in parts])
    return [piece.view(part.shape) for piece, part in zip(pieces, parts, strict=True)]
