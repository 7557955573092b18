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
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_optimizer_state_dict

from trainstack.storage import StorePath, open_binary

if TYPE_CHECKING:
    from trainstack.checkpoint import Checkpoint

METADATA = ".metadata"


@dataclass(frozen=True)
class ShardedState:
    """A nest of state dicts (DTensors welcome) saved with DCP into one folder."""

    state: dict[str, Any]


def save_sharded(folder: Path, state: ShardedState) -> list[Path]:
    """Every rank writes its shards of `state` into `folder` (a collective when
    distributed); return the files this rank wrote."""
    folder.mkdir(parents=True, exist_ok=True)
    before = set(folder.iterdir())
    writer = dcp.FileSystemWriter(folder, single_file_per_rank=True, thread_count=1)
    with _single_process_is_intended():
        dcp.save(state.state, storage_writer=writer)
    return sorted(set(folder.iterdir()) - before)


def has_sharded(checkpoint: Checkpoint, folder: str) -> bool:
    return checkpoint.has(f"{folder}/{METADATA}")


def load_sharded(checkpoint: Checkpoint, folder: str, state: dict[str, Any]) -> None:
    """Fill `state` (this rank's layout) in place from `folder`; a collective when
    distributed, resharding whatever layout wrote it."""
    with _readable(checkpoint, folder) as path, _single_process_is_intended():
        dcp.load(state, storage_reader=dcp.FileSystemReader(path))


def full_state(checkpoint: Checkpoint, folder: str, *, prefix: str) -> dict[str, torch.Tensor]:
    """Whole tensors of the entries under `prefix` (e.g. "model"), in this process alone
    (no collective): `{name: tensor}` with the prefix removed."""
    with _readable(checkpoint, folder) as path:
        reader = dcp.FileSystemReader(path)
        lead = f"{prefix}."
        tensors = {
            key[len(lead) :]: torch.empty(meta.size, dtype=meta.properties.dtype)
            for key, meta in reader.read_metadata().state_dict_metadata.items()
            if key.startswith(lead) and isinstance(meta, TensorStorageMetadata)
        }
        with _single_process_is_intended():
            dcp.load({prefix: tensors}, storage_reader=reader, no_dist=True)
    return tensors


def load_optimizer_by_name(
    checkpoint: Checkpoint, folder: str, model: nn.Module, optimizer: torch.optim.Optimizer
) -> None:
    """The sharded state's optimizer part, keyed by parameter name, into the optimizer of
    a whole (replicated) `model`: a collective when distributed."""
    _, optimizer_state = get_state_dict(model, optimizer)
    state = {"optimizer": optimizer_state}
    load_sharded(checkpoint, folder, state)
    set_optimizer_state_dict(model, optimizer, optim_state_dict=state["optimizer"])


@contextmanager
def _single_process_is_intended() -> Iterator[None]:
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
