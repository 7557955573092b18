"""The on-disk checkpoint format: one directory per checkpoint, verified before use.

    checkpoint_00000120/
      manifest.json        step, samples seen, spec and its hash, strategy, world layout,
                           library versions, metrics, and sha256 + size of every file
      model.pt             portable full model weights (any strategy or world size loads them)
      model/stage_00001.pt or, from a pipeline, one file per stage with that stage's weights
                           under the full model's names (merged, they are model.pt)
      optimizer.pt ...     strategy state, as the strategy lays it out
      state/.metadata      or, from a sharded layout (fsdp, tensor parallel), model and
      state/__0_0.distcp   optimizer state written by torch.distributed.checkpoint, each
                           rank its own shards (sharded.py); any layout reads it
      rng/rank_00000.pt    RNG states (python, numpy, torch) of each rank

Every file is written to a temporary name and renamed; the manifest goes last and is
the proof that a checkpoint is complete. Loading verifies every file's size and hash
first and uses `torch.load(weights_only=True)`.

Checkpoints live in a local folder (a `Path`) or in an object store (a
`storage.StorePath`, `checkpoint.storage_path: s3://bucket/prefix`); every function
here takes either, and verification reads sizes and hashes back from the store itself.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import io
import json
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import trainstack
from trainstack.checkpoint import sharded
from trainstack.config import JobConfig
from trainstack.errors import first_line
from trainstack.files import file_sha256, write_text_atomically
from trainstack.storage import (
    Location,
    StorePath,
    child_dirs,
    delete_tree,
    is_store_uri,
    local_storage,
    open_location,
    size_of,
)

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SHARDED_FOLDER = "state"
"""Where a sharded layout's DCP state lies in a checkpoint: `{"model": ..., "optimizer": ...}`."""
_DIR_PATTERN = re.compile(r"^checkpoint_(\d{8})$")


class CheckpointError(Exception):
    """A checkpoint that cannot be used; the message is one line naming the file."""


class StorageUnreachableError(CheckpointError):
    """The store holding the checkpoints did not answer: nothing can be said about them
    (never taken for a corrupt checkpoint, which would be skipped or pruned)."""


@dataclass(frozen=True, kw_only=True)
class Checkpoint:
    path: Location
    manifest: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    @property
    def samples_seen(self) -> int:
        return int(self.manifest["samples_seen"])

    def load(self, name: str) -> Any:
        """A verified file of this checkpoint, loaded with weights_only=True."""
        file = self.path / name
        if isinstance(file, StorePath):
            with store_errors(file):
                data = io.BytesIO(file.read_bytes())
            return torch.load(data, map_location="cpu", weights_only=True)
        return torch.load(file, map_location="cpu", weights_only=True)

    def has(self, name: str) -> bool:
        return name in self.manifest["files"]

    def full_weights(self) -> dict[str, Any]:
        """The whole model's state dict: `model.pt`, every stage file merged, or the
        sharded state's model part read whole (no collective)."""
        if self.has("model.pt"):
            state: dict[str, Any] = self.load("model.pt")
            return state
        if sharded.has_sharded(self, SHARDED_FOLDER):
            return sharded.full_state(self, SHARDED_FOLDER, prefix="model")
        stages = sorted(name for name in self.manifest["files"] if name.startswith("model/"))
        if not stages:
            raise CheckpointError(f"{self.path}: no model weights (model.pt or model/stage_*)")
        merged: dict[str, Any] = {}
        for name in stages:
            merged.update(self.load(name))
        return merged


def run_dir_for(cfg: JobConfig) -> Path:
    """A run's local directory: fault markers, telemetry and the tracking record, and its
    checkpoints when `checkpoint.storage_path` is a local path (`storage_path/name`). With
    an object store, `.cache/trainstack/runs/<name>` under the working directory."""
    return local_storage(cfg.checkpoint.storage_path) / cfg.name


def checkpoints_for(cfg: JobConfig) -> Location:
    """Where a run's checkpoints are: `run_dir_for(cfg)`, or `storage_path/name` in the
    object store `checkpoint.storage_path` names. Raises ConfigError."""
    if is_store_uri(cfg.checkpoint.storage_path):
        store = open_location(cfg.checkpoint.storage_path, cfg.checkpoint.storage_options)
        return store / cfg.name
    return run_dir_for(cfg)


def location(text: str, cfg: JobConfig) -> Location:
    """`text` (a path or a URI, e.g. `--resume-from`) as a location; a URI's store is
    opened with `cfg`'s `checkpoint.storage_options`. Raises ConfigError."""
    return open_location(text, cfg.checkpoint.storage_options)


def rank_file(folder: str, rank: int) -> str:
    """Name, inside a checkpoint, of the file that `rank` alone writes into `folder`."""
    return f"{folder}/rank_{rank:05d}.pt"


def stage_file(stage: int) -> str:
    """Name, inside a checkpoint, of pipeline stage `stage`'s weights."""
    return f"model/stage_{stage:05d}.pt"


def dir_name(step: int) -> str:
    return f"checkpoint_{step:08d}"


def spec_hash(spec: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def save_atomically(obj: Any, path: Path) -> None:
    """torch.save to a temporary name beside `path`, then rename: never a half file.

    Without zip's CRC32 of each record: the manifest's sha256 verifies every file before
    it is loaded, and the CRC32 was about 40% of torch.save's time (a 1.2 GB state on
    this project's build machine, 10.4 s with it, 6.2 s without); every torch in range
    loads such files."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with _without_zip_crc32():
        torch.save(obj, tmp)
    os.replace(tmp, path)


@contextlib.contextmanager
def _without_zip_crc32() -> Iterator[None]:
    """torch.save's CRC32 off inside (torch.utils.serialization.config), as it was after."""
    from torch.utils.serialization import config

    before = config.save.compute_crc32
    config.save.compute_crc32 = False
    try:
        yield
    finally:
        config.save.compute_crc32 = before


def write_rank_files(
    directory: Path, files: dict[str, Any], *, group: dist.ProcessGroup | None = None
) -> dict[str, dict[str, Any]]:
    """Save this rank's files into `directory`; return their manifest entries. A
    `ShardedState` is a folder that every rank writes its shards into (a collective, over
    `group`: default the default group)."""
    written: list[Path] = []
    for name, obj in files.items():
        if isinstance(obj, sharded.ShardedState):
            written += sharded.save_sharded(directory / name, obj, group=group)
            continue
        save_atomically(obj, directory / name)
        written.append(directory / name)
    return {
        path.relative_to(directory).as_posix(): {
            "sha256": file_sha256(path),
            "size": path.stat().st_size,
        }
        for path in written
    }


def gather_entries(
    entries: dict[str, dict[str, Any]], *, group: dist.ProcessGroup | None = None
) -> dict[str, dict[str, Any]]:
    """Every rank's manifest entries, merged (a collective over `group` when distributed)."""
    if not (dist.is_available() and dist.is_initialized()):
        return dict(entries)
    gathered: list[dict[str, dict[str, Any]] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, entries, group=group)
    merged: dict[str, dict[str, Any]] = {}
    for part in gathered:
        assert part is not None
        merged.update(part)
    return merged


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    """Write the manifest last, atomically: its presence marks the checkpoint complete."""
    write_text_atomically(directory / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))


def build_manifest(
    *,
    step: int,
    samples_seen: int,
    tokens_seen: int,
    spec: dict[str, Any],
    strategy: str,
    world_size: int,
    files: dict[str, dict[str, Any]],
    metrics: dict[str, Any],
    model_shapes: dict[str, list[int]],
    data: dict[str, Any],
    lora: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The manifest's fields. `lora` (a run with `model.lora`): its model files hold the
    adapters alone, and this names the base they load over (`lora_base`)."""
    return {
        "format": FORMAT_VERSION,
        "step": step,
        "samples_seen": samples_seen,
        "tokens_seen": tokens_seen,
        "spec": spec,
        "spec_sha256": spec_hash(spec),
        "strategy": strategy,
        "world": {"world_size": world_size},
        "versions": {
            "trainstack": trainstack.__version__,
            "torch": torch.__version__,
            # Ray's version from its package metadata: a gloo process that never
            # imported Ray would spend 0.1 s importing it for this one string.
            "ray": importlib.metadata.version("ray"),
        },
        "created_unix": time.time(),
        "metrics": metrics,
        "model_shapes": model_shapes,
        "data": data,
        **({"lora": lora} if lora is not None else {}),
        "files": files,
    }


def parameter_shapes(model: torch.nn.Module) -> dict[str, list[int]]:
    """The model's state-dict names and shapes: what a checkpoint must match to load."""
    return {name: list(t.shape) for name, t in model.state_dict().items()}


def verify(path: Location) -> Checkpoint:
    """Check the manifest and every file it lists; raise CheckpointError naming the culprit
    (StorageUnreachableError when the store does not answer)."""
    with store_errors(path):
        return _verify(path)


def _verify(path: Location) -> Checkpoint:
    manifest_path = path / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{manifest_path}: missing (checkpoint incomplete)") from None
    except ValueError as err:
        raise CheckpointError(f"{manifest_path}: unreadable: {err}") from None
    except OSError as err:
        if isinstance(path, StorePath):
            raise
        raise CheckpointError(f"{manifest_path}: unreadable: {err}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{manifest_path}: not a trainstack checkpoint manifest v1")
    for key in ("step", "samples_seen", "spec", "files"):
        if key not in manifest:
            raise CheckpointError(f"{manifest_path}: no '{key}' entry")
    for name, entry in manifest["files"].items():
        file = path / name
        size = size_of(file)
        if size is None:
            raise CheckpointError(f"{file}: missing")
        if size != entry["size"]:
            raise CheckpointError(f"{file}: size {size} != {entry['size']} in manifest")
        try:
            digest = file_sha256(file)
        except FileNotFoundError:  # deleted since (pruned by a newer run's rank 0)
            raise CheckpointError(f"{file}: missing") from None
        if digest != entry["sha256"]:
            raise CheckpointError(f"{file}: sha256 does not match the manifest")
    return Checkpoint(path=path, manifest=manifest)


@contextlib.contextmanager
def store_errors(where: Location) -> Iterator[None]:
    """A store's OSError (not a missing file) as StorageUnreachableError, one line."""
    try:
        yield
    except FileNotFoundError:
        raise
    except OSError as err:
        if not isinstance(where, StorePath):
            raise
        raise unreachable_store(where, err) from None


def unreachable_store(where: StorePath, err: BaseException) -> StorageUnreachableError:
    """The one line for a store that did not answer `err`, whoever met it: a rank, or Ray
    Train's controller writing its own run state beside the checkpoints."""
    reason = first_line(err)
    return StorageUnreachableError(
        f"{where}: the checkpoint store did not answer ({reason[:300]}); check that it is "
        "up and reachable, checkpoint.storage_options and the credentials in the "
        "environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)"
    )


def list_checkpoints(run_dir: Location) -> list[Location]:
    """Checkpoint directories of a run, newest step first."""
    with store_errors(run_dir):
        found = [p for p in child_dirs(run_dir) if _DIR_PATTERN.match(p.name)]
    return sorted(found, key=lambda p: p.name, reverse=True)


def latest_valid(
    run_dir: Location, *, warn: Callable[[str], None]
) -> tuple[Checkpoint | None, int]:
    """The newest checkpoint that verifies, and how many newer ones were skipped as invalid."""
    skipped = 0
    for path in list_checkpoints(run_dir):
        try:
            return verify(path), skipped
        except StorageUnreachableError:
            raise
        except CheckpointError as err:
            warn(f"skipping checkpoint {path.name}: {err}")
            skipped += 1
    return None, skipped


def prune(run_dir: Location, *, keep: int) -> None:
    """Keep the newest `keep` checkpoints that verify and delete the rest, so the newest
    valid one is never deleted (nor anything, when none verifies).

    A checkpoint newer than the newest valid one that does not verify is left alone: it
    may still be being written (under Ray Train every rank uploads its own files, and
    rank 0, which prunes, can finish first); `find_start` skips it while it is
    incomplete. One that does not verify and is older than a valid one is a cut-off
    save, and goes.
    """
    kept = 0
    for path in list_checkpoints(run_dir):
        if kept < keep and _verifies(path):
            kept += 1
        elif kept > 0:
            delete_tree(path)


def _verifies(path: Location) -> bool:
    try:
        verify(path)
    except StorageUnreachableError:
        raise
    except CheckpointError:
        return False
    return True


def read(path: Location) -> Checkpoint:
    """A checkpoint another process already verified: its manifest, without re-hashing."""
    with store_errors(path):
        return Checkpoint(path=path, manifest=json.loads((path / MANIFEST).read_text()))
