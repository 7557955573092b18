"""Sharded state inside a trainstack checkpoint, written by torch.distributed.checkpoint.

A strategy whose ranks each hold part of the model (fsdp, tensor parallel) returns a
`ShardedState` under a folder name from `checkpoint_files()`. Every rank then calls
DCP's save into that folder of its own staging directory (a collective): rank r writes
`__r_0.distcp` with the shards it holds (a replicated tensor is written once), rank 0
also `.metadata`, which says which part of which tensor lies where. The files are
listed and hashed in the manifest like any other, and verified before loading.

Loading reshards: DCP reads into the state dict of whatever layout asks (another mesh,
another world size), fetching each rank's part from whichever files hold it. Without
a process group (or outside the group's collectives) `full_state` reads whole tensors,
which is how any strategy gets portable weights from a sharded checkpoint.
"""

from __future__ import annotations

import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from trainstack.storage import StorePath, open_binary

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from trainstack.checkpoint import Checkpoint

# torch.distributed.checkpoint, and DTensor with `checkpoint.blocks`, are imported where
# they are used: they cost every process that imports trainstack.checkpoint most of a
# second each, and only sharded layouts need them.

METADATA = ".metadata"


@dataclass(frozen=True)
class ShardedState:
    """A nest of state dicts (DTensors welcome) saved with DCP into one folder."""

    state: dict[str, Any]


def save_sharded(
    folder: Path, state: ShardedState, *, group: ProcessGroup | None = None
) -> list[Path]:
    """Every rank writes its shards of `state` into `folder` (a collective over `group`,
    default the default group, when distributed); return the files this rank wrote."""
    import torch.distributed.checkpoint as dcp

    from trainstack.checkpoint.blocks import as_blocks

    folder.mkdir(parents=True, exist_ok=True)
    before = set(folder.iterdir())
    writer = dcp.FileSystemWriter(folder, single_file_per_rank=True, thread_count=1)
    with single_process_is_intended(), as_blocks(state.state):
        dcp.save(state.state, storage_writer=writer, process_group=group)
    return sorted(set(folder.iterdir()) - before)


def has_sharded(checkpoint: Checkpoint, folder: str) -> bool:
    return checkpoint.has(f"{folder}/{METADATA}")


def load_sharded(checkpoint: Checkpoint, folder: str, state: dict[str, Any]) -> None:
    """Fill `state` (this rank's layout) in place from `folder`; a collective when
    distributed, resharding whatever layout wrote it."""
    import torch.distributed.checkpoint as dcp

    from trainstack.checkpoint.blocks import as_blocks

    with _readable(checkpoint, folder) as path, single_process_is_intended(), as_blocks(state):
        dcp.load(state, storage_reader=dcp.FileSystemReader(path))


def full_state(checkpoint: Checkpoint, folder: str, *, prefix: str) -> dict[str, torch.Tensor]:
    """Whole tensors of the entries under `prefix` (e.g. "model"), in this process alone
    (no collective): `{name: tensor}` with the prefix removed."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    with _readable(checkpoint, folder) as path:
        reader = dcp.FileSystemReader(path)
        lead = f"{prefix}."
        tensors = {
            key[len(lead) :]: torch.empty(meta.size, dtype=meta.properties.dtype)
            for key, meta in reader.read_metadata().state_dict_metadata.items()
            if key.startswith(lead) and isinstance(meta, TensorStorageMetadata)
        }
        with single_process_is_intended():
            dcp.load({prefix: tensors}, storage_reader=reader, no_dist=True)
    return tensors


def optimizer_state_by_parameter(
    checkpoint: Checkpoint, folder: str, params: list[tuple[nn.Parameter, tuple[str, ...]]]
) -> tuple[dict[nn.Parameter, dict[str, Any]], list[str]]:
    """The sharded state's optimizer state of each parameter in `params` (given with the
    model's names for it: a tied one has several), read into tensors placed like the
    parameter: this rank's part of a tensor-parallel one. A collective when distributed
    (every rank calls it, each with its own parameters). Returns the states, and the
    names of the parameters the checkpoint holds no state for."""
    import torch.distributed.checkpoint as dcp

    with _readable(checkpoint, folder) as path:
        reader = dcp.FileSystemReader(path)
        saved = reader.read_metadata().state_dict_metadata
        template: dict[str, dict[str, Any]] = {}
        owners: dict[str, list[nn.Parameter]] = {}
        missing: list[str] = []
        for param, names in params:
            found = [(n, _saved_entry(saved, n)) for n in names]
            name, entry = next(((n, e) for n, e in found if e), (names[0], {}))
            if not entry:
                missing.append(name)
                continue
            template.setdefault(name, {k: _like(param, meta) for k, meta in entry.items()})
            owners.setdefault(name, []).append(param)
        with single_process_is_intended():
            dcp.load({"optimizer": {"state": template}}, storage_reader=reader)
    states = {
        param: {k: v.clone() for k, v in template[name].items()}
        for name, held in owners.items()
        for param in held
    }
    return states, missing


def _saved_entry(saved: dict[str, Any], name: str) -> dict[str, TensorStorageMetadata]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    lead = f"optimizer.state.{name}."
    return {
        key[len(lead) :]: meta
        for key, meta in saved.items()
        if key.startswith(lead) and isinstance(meta, TensorStorageMetadata)
    }


def _like(param: nn.Parameter, meta: TensorStorageMetadata) -> torch.Tensor:
    """An empty tensor for a saved optimizer tensor: placed like `param` if it has the
    parameter's shape (a moment), else whole (a step count)."""
    if tuple(meta.size) == tuple(param.shape):
        return torch.zeros_like(param, dtype=meta.properties.dtype)
    return torch.zeros(meta.size, dtype=meta.properties.dtype)


@contextmanager
def single_process_is_intended() -> Iterator[None]:
    """Without a process group DCP warns that it assumes one process: here it is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=".*assuming the intent is to", category=UserWarning
        )
        yield


@contextmanager
def _readable(checkpoint: Checkpoint, folder: str) -> Iterator[Path]:
    """`folder` as a local directory: itself, or a copy of its files from an object store."""
    source = checkpoint.path / folder
    if not isinstance(source, StorePath):
        yield source
        return
    lead = f"{folder}/"
    with tempfile.TemporaryDirectory(prefix="trainstack-dcp-") as tmp:
        for name in checkpoint.manifest["files"]:
            if name.startswith(lead):
                with open_binary(checkpoint.path / name) as src:
                    (Path(tmp) / name[len(lead) :]).write_bytes(src.read())
        yield Path(tmp)
