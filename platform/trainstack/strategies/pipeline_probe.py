"""What a pipeline stage measures about itself: compute time and activation memory.

`ProbedStage` is torch's `PipelineStage` with its three compute calls (forward,
backward for inputs, backward for weights) timed; the time a rank spends in a step
outside them is its share of the bubble (waiting for neighbours, plus the
schedule's own bookkeeping and loss, which are small). `SavedActivationMeter`
counts the bytes autograd saves for backward while a forward runs, so its peak is the
activation memory a schedule holds at once.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed.pipelining import PipelineStage


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
        storage = tensor.untyped_storage()
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


class ProbedStage(PipelineStage):
    """A `PipelineStage` that adds up its compute seconds and meters its activations."""

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
