"""What a pipeline stage measures about itself: compute time, activation memory, and
the size of what crosses its boundaries.

`ProbedStage` is torch's `PipelineStage` with its three compute calls (forward,
backward for inputs, backward for weights) timed; the time a rank spends in a step
outside them is its share of the bubble (waiting for neighbours, plus the
schedule's own bookkeeping and loss, which are small). `SavedActivationMeter`
counts the bytes autograd saves for backward while a forward runs, so its peak is the
activation memory a schedule holds at once. `BoundaryMeter` records the bytes a stage
module takes in and gives out per micro-batch, from which a strategy models the bytes
its activations and their gradients put on the wire.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor

from trainstack.compat import torch as torch_compat


class SavedActivationMeter:
    """Live and peak bytes of the tensors autograd keeps for backward.

    A tensor is counted from the forward that saved it until its graph is freed (after
    its backward). Storage shared by several saved tensors counts once; tensors whose
    storage is in `exclude` (the parameters, saved by every matmul) do not count.
    """

    def __init__(self, *, exclude: set[int] | None = None) -> None:
        self.exclude = exclude or set()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._refs: dict[int, int] = {}

    @contextmanager
    def recording(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
            yield

    def _pack(self, tensor: torch.Tensor) -> Any:
        held = tensor.to_local() if isinstance(tensor, DTensor) else tensor  # its own part
        storage = held.untyped_storage()
        key = storage.data_ptr()
        if key in self.exclude or storage.nbytes() == 0:
            return tensor
        return _Saved(tensor, meter=self, key=key, nbytes=storage.nbytes())

    def _acquire(self, key: int, nbytes: int) -> None:
        count = self._refs.get(key, 0)
        self._refs[key] = count + 1
        if count == 0:
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _release(self, key: int, nbytes: int) -> None:
        count = self._refs.pop(key) - 1
        if count:
            self._refs[key] = count
        else:
            self.live_bytes -= nbytes


class _Saved:
    """A saved tensor that tells its meter when autograd lets go of it."""

    __slots__ = ("key", "meter", "nbytes", "tensor")

    def __init__(
        self, tensor: torch.Tensor, *, meter: SavedActivationMeter, key: int, nbytes: int
    ) -> None:
        self.tensor, self.meter, self.key, self.nbytes = tensor, meter, key, nbytes
        meter._acquire(key, nbytes)

    def __del__(self) -> None:
        self.meter._release(self.key, self.nbytes)


def _unpack(saved: Any) -> torch.Tensor:
    return saved.tensor if isinstance(saved, _Saved) else saved


class BoundaryMeter:
    """Bytes of one training micro-batch at a stage module's boundaries, as measured in
    its latest forward in training mode (0 before the first).

    `output_bytes` is what the stage sends on (activations); `input_grad_bytes` what it
    sends back (the gradient of each floating-point input, the size of that input).
    """

    def __init__(self, module: nn.Module) -> None:
        self.output_bytes = 0
        self.input_grad_bytes = 0
        module.register_forward_hook(self._record)

    def _record(self, module: nn.Module, args: Any, output: Any) -> None:
        if module.training:
            self.output_bytes = sum(_nbytes(t) for t in _tensors(output))
            inputs = [t for t in _tensors(args) if t.is_floating_point()]
            self.input_grad_bytes = sum(_nbytes(t) for t in inputs)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for item in value for t in _tensors(item)]
    return []


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def first_replica_figures(
    mine: dict[str, Any], *, world_size: int
) -> tuple[list[dict[str, Any]], list[float]]:
    """Every rank's `mine` (with `pp_rank`, `dp_rank`, `busy_s`, `step_s`, optionally
    `tp_rank`) gathered: replica 0's (tp rank 0's) in pipeline order, and each one's
    bubble, 1 - busy/step. A collective."""
    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, mine)
    firsts = (r for r in everyone if r["dp_rank"] == 0 and r.get("tp_rank", 0) == 0)
    replica0 = sorted(firsts, key=lambda r: r["pp_rank"])
    bubbles = [1.0 - r["busy_s"] / r["step_s"] if r["step_s"] else math.nan for r in replica0]
    return replica0, bubbles


class ProbedStage(torch_compat.ShapeInferenceLeavesNoTrace, torch_compat.GlooWarmup, PipelineStage):
    """A `PipelineStage` that adds up its compute seconds and meters its activations.

    At the first step torch infers the shapes passed between stages with one real
    forward (on empty tensors past the first stage, and a backward since torch 2.12);
    the stage's buffers (batch-norm statistics) and the random generators are as they
    were before it once that is done (`torch_compat.ShapeInferenceLeavesNoTrace`); on
    torch 2.9 to 2.11 the links between stages are warmed up as gloo can
    (`torch_compat.GlooWarmup`).
    """

    def __init__(self, *args: Any, meter: SavedActivationMeter, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.meter = meter
        self.busy_s = 0.0

    def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        with self.meter.recording():
            out = super().forward_one_chunk(*args, **kwargs)
        self.busy_s += time.perf_counter() - start
        return out

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = super().backward_one_chunk(*args, **kwargs)
        self.busy_s += time.perf_counter() - start
        return out

    def backward_weight_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = super().backward_weight_one_chunk(*args, **kwargs)
        self.busy_s += time.perf_counter() - start
        return out


# ---- the schedule's own bubble, with no communication and equal stages -------------------

ACTION_COSTS: dict[str, float] = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
"""Relative compute time of a stage's forward, full backward, backward for inputs and
backward for weights (a backward costs twice a forward, split evenly by zero-bubble)."""

Action = tuple[str, int, int]
"""(kind, stage, micro-batch): kind F, B (full backward), I (input grads) or W (weight grads)."""


def single_stage_orders(
    schedule: str, *, pp_size: int, microbatches: int
) -> dict[int, list[Action]]:
    """The order in which each rank runs its one stage's actions under GPipe or 1F1B."""
    orders: dict[int, list[Action]] = {}
    for r in range(pp_size):
        forwards = [("F", r, i) for i in range(microbatches)]
        backwards = [("B", r, i) for i in range(microbatches)]
        if schedule == "gpipe":
            orders[r] = forwards + backwards
            continue
        warmup = min(microbatches, pp_size - 1 - r)
        order = forwards[:warmup]
        for i in range(microbatches - warmup):
            order += [forwards[warmup + i], backwards[i]]
        orders[r] = order + backwards[microbatches - warmup :]
    return orders


def simulated_bubble(orders: dict[int, list[Action]], *, num_stages: int) -> float:
    """Mean idle fraction of the ranks when each runs its actions in order, each action
    starting once its rank is free and its inputs exist, with ACTION_COSTS durations."""
    finished: dict[tuple[str, int, int], float] = {}
    clock = dict.fromkeys(orders, 0.0)
    busy = dict.fromkeys(orders, 0.0)
    position = dict.fromkeys(orders, 0)

    def ready_at(kind: str, stage: int, mb: int) -> float | None:
        if kind == "F":
            needed = [] if stage == 0 else [("F", stage - 1, mb)]
        elif kind in ("B", "I"):
            if stage == num_stages - 1:
                needed = [("F", stage, mb)]
            else:  # the next stage's input gradient, from a full or an input-only backward
                grad = ("B", stage + 1, mb) if ("B", stage + 1, mb) in finished else None
                needed = [grad or ("I", stage + 1, mb)]
        else:
            needed = [("I", stage, mb)]
        if any(n not in finished for n in needed):
            return None
        return max((finished[n] for n in needed), default=0.0)

    remaining = sum(len(order) for order in orders.values())
    while remaining:
        progressed = False
        for rank, order in orders.items():
            while position[rank] < len(order):
                kind, stage, mb = order[position[rank]]
                inputs = ready_at(kind, stage, mb)
                if inputs is None:
                    break
                start = max(clock[rank], inputs)
                clock[rank] = start + ACTION_COSTS[kind]
                busy[rank] += ACTION_COSTS[kind]
                finished[(kind, stage, mb)] = clock[rank]
                position[rank] += 1
                remaining -= 1
                progressed = True
        assert progressed, "the schedule deadlocks"
    makespan = max(clock.values())
    return sum(1.0 - b / makespan for b in busy.values()) / len(busy)
