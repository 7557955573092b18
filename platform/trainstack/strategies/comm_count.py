"""Bytes a rank puts on the wire, counted from the collectives it really issues.

`CollectiveBytes` is a dispatch mode: every process-group collective (FSDP2's
all-gathers and reduce-scatters, DDP-style all-reduces) and every functional collective
(what DTensor and tensor parallelism issue) passes through it on the way to its
backend, and it adds the bytes a ring implementation of that collective sends from
this rank: all-gather (n-1) × input, reduce-scatter (n-1)/n × input, all-reduce
2(n-1)/n × the buffer, for a group of n ranks. A dispatch mode sees every operator, so
strategies count one step with it, not every step. Where torch offers no dispatch mode
(`torch_compat.collective_dispatch_mode`), nothing is counted (`counting` is False)
and strategies model their bytes instead.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from trainstack.compat import torch as torch_compat


def _nbytes(tensors: Any) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(_nbytes(t) for t in tensors)


def _numel(tensors: Any) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel()
    return sum(_numel(t) for t in tensors)


def _group_size(group: Any) -> int:
    """A collective's group size: a ProcessGroup as the dispatcher passes it (boxed, c10d
    ops) or a group name (functional collectives)."""
    if isinstance(group, str):
        return torch_compat.group_size_by_name(group)
    if not isinstance(group, dist.ProcessGroup):
        group = dist.ProcessGroup.unbox(group)
    return int(group.size())


def _gathered(inputs: Any, n: int) -> int:
    """All-gather: each rank's input goes to the n - 1 others."""
    return (n - 1) * _nbytes(inputs)


def _scattered(inputs: Any, n: int) -> int:
    """Reduce-scatter: (n - 1)/n of each rank's input leaves it."""
    return (n - 1) * _nbytes(inputs) // n


def _reduced(buffer: Any, n: int) -> int:
    """All-reduce (ring: a reduce-scatter then an all-gather): 2(n - 1)/n of the buffer."""
    return 2 * (n - 1) * _nbytes(buffer) // n


def _bytes_sent(name: str, args: tuple[Any, ...]) -> int | None:
    """Bytes this rank sends in collective `name` called with `args` (None: not one)."""
    if name in ("c10d._allgather_base_", "c10d.allgather_into_tensor_coalesced_"):
        return _gathered(args[1], _numel(args[0]) // max(1, _numel(args[1])))
    if name == "c10d.allgather_":
        return _gathered(args[1], len(args[0][0]))
    if name in ("c10d._reduce_scatter_base_", "c10d.reduce_scatter_tensor_coalesced_"):
        return _scattered(args[1], _numel(args[1]) // max(1, _numel(args[0])))
    if name in ("c10d.allreduce_", "c10d.allreduce_coalesced_"):
        return _reduced(args[0], _group_size(args[1]))
    if name.startswith("_c10d_functional.all_gather_into_tensor"):
        return _gathered(args[0], int(args[1]))
    if name.startswith("_c10d_functional.reduce_scatter_tensor"):
        return _scattered(args[0], int(args[2]))
    if name.startswith("_c10d_functional.all_reduce"):
        return _reduced(args[0], _group_size(args[2]))
    return None


class CollectiveBytes:
    """Adds up the bytes this rank sends in the collectives run while it is active (a
    context manager; `counting` says whether this torch lets it see them)."""

    def __init__(self) -> None:
        self.sent = 0
        self._mode = torch_compat.collective_dispatch_mode(self._saw)
        self.counting = self._mode is not None

    def _saw(self, name: str, args: tuple[Any, ...]) -> None:
        sent = _bytes_sent(name, args)
        if sent is not None:
            self.sent += sent

    def __enter__(self) -> CollectiveBytes:
        if self._mode is not None:
            self._mode.__enter__()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._mode is not None:
            self._mode.__exit__(kind, error, traceback)
