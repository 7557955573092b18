"""Saving a run's checkpoints off the step's critical path.

A save has two halves. The first is the strategy's: `checkpoint_files()` (which may be
a collective, e.g. ZeRO-3 gathering whole weights) on the training thread. The second
writes those files, hashes them, lists them in the manifest and commits the checkpoint.
With `checkpoint.async_save` (the default) each rank first copies its state to host
memory (`HostStager`; pinned where the state is on a GPU, its buffers reused from save
to save) and the second half runs in a thread of its own while training goes on. Its
collectives (gathering the manifest entries, DCP's sharded save, the directory store's
barriers) go over a gloo group of their own, so they never interleave with the step's.

The manifest is still written last, by rank 0, once every rank's files are in: a crash
mid-write leaves the previous checkpoint the newest one that verifies, as a synchronous
save does. At most one save is in flight: the next one (and the end of the run) waits
for it, and the wait is counted as a stall (`SaveTimes`).
"""

from __future__ import annotations

import copy
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from trainstack import checkpoint as ckpt
from trainstack.checkpoint.sharded import ShardedState
from trainstack.storage import Location


class CheckpointStore(Protocol):
    """Where a rank's staged checkpoint files go: Ray Train's storage, or a local directory."""

    def commit(
        self,
        staging: Path,
        *,
        name: str,
        metrics: dict[str, Any],
        group: dist.ProcessGroup | None = None,
    ) -> None:
        """Make this rank's files in `staging` part of checkpoint `name`. A collective
        (over `group` where it uses torch.distributed's)."""


class DirectoryCheckpointStore:
    """Ranks copy their staged files into `.partial-<name>`; rank 0 renames it into place.

    The store of `runtime/gloo_processes.py`'s processes, and of the parameter server's driver for
    its final checkpoint (one rank, not distributed)."""

    def __init__(self, run_dir: Path, *, rank: int, distributed: bool) -> None:
        self.run_dir = run_dir
        self.rank = rank
        self.distributed = distributed

    def commit(
        self,
        staging: Path,
        *,
        name: str,
        metrics: dict[str, Any],
        group: dist.ProcessGroup | None = None,
    ) -> None:
        partial = self.run_dir / f".partial-{name}"
        _move_tree(staging, partial)
        if self.distributed:
            dist.barrier(group=group)
        if self.rank == 0:
            final = self.run_dir / name
            if final.exists():
                shutil.rmtree(final)
            os.replace(partial, final)
        if self.distributed:
            dist.barrier(group=group)


def _move_tree(source: Path, target: Path) -> None:
    """Every file under `source` into the same place under `target` (merged with what
    other ranks put there): renamed where both are on one filesystem, else copied."""
    for path in sorted(p for p in source.rglob("*") if p.is_file()):
        destination = target / path.relative_to(source)
        destination.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(path, destination)
        except OSError:  # another filesystem: a copy (the staging folder is deleted after)
            shutil.copy2(path, destination)


@dataclass
class SaveTimes:
    """Where a rank's checkpoint time went."""

    saves: int = 0
    stall_s: float = 0.0
    """Seconds the training thread spent on saves: the strategy's state, the copy to host
    memory, and waiting for a save in flight (all of a synchronous save)."""
    write_s: float = 0.0
    """Seconds of writing, hashing and committing (in the background when asynchronous)."""
    last_stall_s: float = 0.0

    def metrics(self) -> dict[str, Any]:
        return {
            "checkpoint_saves": self.saves,
            "checkpoint_stall_s": self.stall_s,
            "checkpoint_write_s": self.write_s,
        }


class HostStager:
    """Copies of a rank's checkpoint state that the training thread may not change: every
    tensor copied to host memory (pinned when it lives on a GPU) into buffers kept from
    one save to the next, every other value deep-copied (an optimizer's learning rate
    changes each step). A tensor that appears twice (tied weights) is copied once and
    appears twice. A DTensor on a GPU mesh is copied on its device: DTensor keeps its
    local part on the mesh's device type."""

    def __init__(self) -> None:
        self.kept: dict[tuple[Any, ...], torch.Tensor] = {}

    def stage(self, files: dict[str, Any]) -> dict[str, Any]:
        memo: dict[Any, Any] = {}
        staged = {name: self._copy(obj, (name,), memo) for name, obj in files.items()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # the non-blocking copies to pinned memory have landed
        return staged

    def _copy(self, obj: Any, path: tuple[Any, ...], memo: dict[Any, Any]) -> Any:
        if id(obj) in memo:
            return memo[id(obj)]
        out: Any
        if isinstance(obj, ShardedState):
            out = ShardedState(self._copy(obj.state, path, memo))
        elif isinstance(obj, torch.Tensor):
            out = self._tensor(obj, path, memo)
        elif isinstance(obj, dict):
            out = copy.copy(obj)  # keeps the mapping's type (OrderedDict, ...)
            for key, value in obj.items():
                out[key] = self._copy(value, (*path, key), memo)
        elif isinstance(obj, list):
            out = [self._copy(value, (*path, i), memo) for i, value in enumerate(obj)]
        elif type(obj) is tuple:
            out = tuple(self._copy(value, (*path, i), memo) for i, value in enumerate(obj))
        else:
            out = copy.deepcopy(obj)
        memo[id(obj)] = out
        return out

    def _tensor(
        self, tensor: torch.Tensor, path: tuple[Any, ...], memo: dict[Any, Any]
    ) -> torch.Tensor:
        dtensor = _dtensor_class()
        if dtensor is not None and isinstance(tensor, dtensor):
            if tensor.device_mesh.device_type != "cpu":
                return tensor.detach().clone()
            local = self._host_copy(tensor.to_local(), path, memo)
            return dtensor.from_local(
                local,
                tensor.device_mesh,
                tensor.placements,
                run_check=False,
                shape=tensor.shape,
                stride=tensor.stride(),
            )
        return self._host_copy(tensor, path, memo)

    def _host_copy(
        self, tensor: torch.Tensor, path: tuple[Any, ...], memo: dict[Any, Any]
    ) -> torch.Tensor:
        """`tensor` as the same view of a host copy of its storage: tensors that share a
        storage (tied weights, views of a flat buffer) share the copy, and torch.save
        writes the copy exactly as it would have written the original."""
        tensor = tensor.detach()
        storage = tensor.untyped_storage()
        key = ("storage", tensor.device, storage.data_ptr())
        copied = memo.get(key)
        if copied is None:
            buffer = self.kept.get(path)
            if buffer is None or buffer.numel() != storage.nbytes():
                buffer = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=tensor.is_cuda)
                self.kept[path] = buffer
            source = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
            buffer.copy_(source, non_blocking=tensor.is_cuda)
            copied = memo[key] = buffer.untyped_storage()
        view = torch.empty(0, dtype=tensor.dtype)
        return view.set_(copied, tensor.storage_offset(), tensor.shape, tensor.stride())


def _dtensor_class() -> Any | None:
    """DTensor when this process has imported it (no DTensor exists otherwise): importing
    it costs a process that never shards most of a second."""
    if "torch.distributed.tensor" not in sys.modules:
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


class CheckpointSaver:
    """One rank's checkpoint writer: synchronous, or in the background (one save in
    flight). Every rank makes one, at the same point (making the background group is a
    collective), and every rank calls `save` for the same steps."""

    def __init__(
        self,
        *,
        rank: int,
        distributed: bool,
        store: CheckpointStore,
        checkpoints: Location,
        keep: int,
        background: bool,
    ) -> None:
        self.rank = rank
        self.store = store
        self.checkpoints = checkpoints
        self.keep = keep
        self.times = SaveTimes()
        self._group = dist.new_group(backend="gloo") if background and distributed else None
        self._stager = HostStager() if background else None
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None

    def save(
        self,
        files: Callable[[], dict[str, Any]],
        *,
        name: str,
        metrics: dict[str, Any],
        manifest: Callable[[dict[str, dict[str, Any]]], dict[str, Any]],
        written: Callable[[], None] | None = None,
    ) -> None:
        """Save checkpoint `name`: `files()` is this rank's state (called here, on the
        training thread), `manifest(entries)` rank 0's manifest given every rank's file
        entries; `written()` runs once this rank's files are written, before anything is
        committed (faults use it). Returns once the state is copied (background) or
        committed."""
        started = time.perf_counter()
        self._join()
        state = files()
        if self._stager is None:
            self._write(state, name=name, metrics=metrics, manifest=manifest, written=written)
        else:
            staged = self._stager.stage(state)
            del state
            self._thread = threading.Thread(
                target=self._write_in_background,
                kwargs={
                    "state": staged,
                    "name": name,
                    "metrics": metrics,
                    "manifest": manifest,
                    "written": written,
                },
                name=f"trainstack-checkpoint-{name}",
                daemon=True,
            )
            self._thread.start()
        self.times.last_stall_s = time.perf_counter() - started
        self.times.stall_s += self.times.last_stall_s
        self.times.saves += 1

    def wait(self) -> None:
        """Return once no save is in flight (the wait counts as a stall); raise what a
        background save raised."""
        started = time.perf_counter()
        try:
            self._join()
        finally:
            self.times.stall_s += time.perf_counter() - started

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise RuntimeError(f"writing a checkpoint failed: {failure}") from failure

    def _write_in_background(self, **kwargs: Any) -> None:
        try:
            self._write(**kwargs)
        except BaseException as err:  # handed to the training thread by `wait`
            self._failure = err

    def _write(
        self,
        state: dict[str, Any],
        *,
        name: str,
        metrics: dict[str, Any],
        manifest: Callable[[dict[str, dict[str, Any]]], dict[str, Any]],
        written: Callable[[], None] | None,
    ) -> None:
        """Every rank writes its files; rank 0 adds the manifest listing all of them."""
        started = time.perf_counter()
        group = self._group
        with tempfile.TemporaryDirectory(prefix="trainstack-ckpt-") as tmp:
            staging = Path(tmp)
            entries = ckpt.write_rank_files(staging, state, group=group)
            if written is not None:
                written()
            entries = ckpt.gather_entries(entries, group=group)
            if self.rank == 0:
                ckpt.write_manifest(staging, manifest(entries))
            self.store.commit(staging, name=name, metrics=metrics, group=group)
        if self.rank == 0:
            ckpt.prune(self.checkpoints, keep=self.keep)
        self.times.write_s += time.perf_counter() - started
