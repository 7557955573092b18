"""A Hugging Face `save_pretrained` folder's safetensors, read in parts.

`saved_shapes` reads the files' headers alone (names and shapes, no data): the
folder's tensors, where its files are the plain set transformers writes (one
`model.safetensors`, or the files `model.safetensors.index.json` names, and no other
`.safetensors` beside them). `read_parts` fills tensors in place from those files with
torch.distributed.checkpoint, which plans what each rank reads: a DTensor takes only
this rank's part of its tensor. Its Hugging Face reader is kept for the planning; the
bytes are read here with plain file reads of each part's contiguous runs
(`SliceReader`), not through a memory map, which would keep every file page a rank
touched resident in it until the file closes (as much again as the part it keeps).
`read_runs` reads runs of flattened tensors the same way, without DCP's planning (a
ZeRO-3 partition: one byte range of one file). A file's header is read once per
process, whoever asks (`_header`: the model's check of names and shapes, DCP's
planning, the reads), and again only when the file changes.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import math
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, TypeVar, cast

import torch

from trainstack.checkpoint.sharded import single_process_is_intended
from trainstack.files import file_sha256

SINGLE_FILE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def saved_files(folder: Path) -> list[Path] | None:
    """The folder's weight files as transformers reads them; None where it holds no
    safetensors, or more of them than its index (or the single file) names."""
    index = folder / INDEX
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        names = [SINGLE_FILE]
    present = sorted(p.name for p in folder.glob("*.safetensors"))
    if present != names:
        return None
    return [folder / name for name in names]


@functools.lru_cache(maxsize=8)
def _fingerprint(folder: Path, listing: tuple[tuple[str, int, int], ...]) -> str:
    digest = hashlib.sha256()
    for name, size, _ in listing:
        digest.update(json.dumps([name, size, file_sha256(folder / name)]).encode())
    return digest.hexdigest()


def folder_fingerprint(folder: str | Path) -> str:
    """sha256 over a save_pretrained folder's config and weights: every `.json` and
    `.safetensors` file's name, size and contents (moving the folder keeps it, another
    base changes it). Hashed once while sizes and times hold: reading a large model's
    weights takes seconds."""
    path = Path(folder).expanduser().resolve()
    files = sorted(p for p in path.iterdir() if p.suffix in (".json", ".safetensors"))
    listing = tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    return _fingerprint(path, listing)


def saved_shapes(folder: Path) -> dict[str, list[int]] | None:
    """Each saved tensor's name and shape, from the files' headers; None where the
    folder is not a plain set of safetensors files (`saved_files`) or a header does not
    read (transformers' own loading then says why)."""
    saved = saved_tensors(folder)
    return None if saved is None else {name: list(at.tensor.shape) for name, at in saved.items()}


@dataclass(frozen=True)
class SavedTensor:
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class SavedAt:
    """Where a saved tensor is: its file and first byte there, and what it is."""

    path: Path
    start: int
    tensor: SavedTensor


def saved_tensors(folder: Path) -> dict[str, SavedAt] | None:
    """Each saved tensor by name, from the files' headers (`_header`); None as for
    `saved_shapes`."""
    files = saved_files(folder)
    if files is None:
        return None
    found: dict[str, SavedAt] = {}
    try:
        for path in files:
            for name, (start, tensor) in _header(path).items():
                found[name] = SavedAt(path=path, start=start, tensor=tensor)
    except (OSError, ValueError, struct.error):
        return None
    return found


def read_parts(folder: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Copy each saved tensor named in `tensors` into it, in place (converted to its
    dtype): a DTensor gets its local part only. A collective when distributed: every
    rank calls it, each with its own tensors (a pipeline's ranks hold different keys)."""
    import torch.distributed.checkpoint as dcp

    from trainstack.checkpoint.blocks import as_blocks  # DTensor: see checkpoint.sharded

    with single_process_is_intended(), as_blocks(tensors):
        dcp.load(tensors, storage_reader=_slice_reader(folder))


def read_runs(folder: Path, runs: Mapping[str, tuple[int, torch.Tensor]]) -> None:
    """Fill each 1-D tensor of `runs` (a saved name -> (first, into)) with that saved
    tensor's flattened elements from `first` on, converted to its dtype: one contiguous
    byte range of one file each (a ZeRO-3 partition; a whole tensor from 0). Not a
    collective: each rank reads its own runs."""
    saved = saved_tensors(folder)
    assert saved is not None, "build_hf_model loads such a folder whole"
    for f, names in _opened_by_file(runs, lambda name: saved[name].path):
        for name in names:
            at = saved[name]
            first, into = runs[name]
            flat = SavedTensor(shape=(math.prod(at.tensor.shape),), dtype=at.tensor.dtype)
            read_slice(f, start=at.start, saved=flat, offsets=(first,), into=into)


T = TypeVar("T")


def _opened_by_file(
    items: Iterable[T], path_of: Callable[[T], Path]
) -> Iterator[tuple[BinaryIO, list[T]]]:
    """`items` grouped by the file each is read from, with that file open (once)."""
    by_file: dict[Path, list[T]] = {}
    for item in items:
        by_file.setdefault(path_of(item), []).append(item)
    for path, group in by_file.items():
        with open(path, "rb", buffering=0) as f:
            yield f, group


def _slice_reader(folder: Path) -> Any:
    """A `SliceReader` (defined here: torch.distributed.checkpoint loads on first use)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    class SliceReader(FileSystemReader):
        """DCP's reader of a folder, planning from this module's headers (`SavedAt` as
        each tensor's storage data) and reading with `read_slice`: what DCP's
        `HuggingFaceStorageReader` (a FileSystemReader too, public from torch 2.8)
        reads, on any torch."""

        def read_metadata(self) -> Metadata:
            saved = saved_tensors(folder)
            assert saved is not None, "build_hf_model loads such a folder whole"
            tensors = {}
            storage: dict[MetadataIndex, Any] = {}
            for name, at in saved.items():
                shape = torch.Size(at.tensor.shape)
                whole = ChunkStorageMetadata(offsets=torch.Size([0] * len(shape)), sizes=shape)
                tensors[name] = TensorStorageMetadata(
                    properties=TensorProperties(dtype=at.tensor.dtype), size=shape, chunks=[whole]
                )
                storage[MetadataIndex(fqn=name, offset=[0] * len(shape))] = at
            metadata = Metadata(state_dict_metadata=tensors, storage_data=storage)  # type: ignore[arg-type]
            metadata.storage_meta = StorageMeta(load_id=self.load_id)
            return metadata

        def read_data(self, plan: Any, planner: Any) -> torch.futures.Future[None]:
            def where(item: Any) -> SavedAt:
                return cast(SavedAt, self.storage_data[item.storage_index])

            for f, items in _opened_by_file(plan.items, lambda item: where(item).path):
                for item in items:
                    target = planner.resolve_tensor(item).detach()
                    offsets = tuple(item.storage_offsets)
                    at = where(item)
                    read_slice(f, start=at.start, saved=at.tensor, offsets=offsets, into=target)
                    planner.commit_tensor(item, target)
            done: torch.futures.Future[None] = torch.futures.Future()
            done.set_result(None)
            return done

    return SliceReader(str(folder))


def read_slice(
    f: BinaryIO, *, start: int, saved: SavedTensor, offsets: tuple[int, ...], into: torch.Tensor
) -> None:
    """Read the part of a row-major tensor saved at byte `start` of `f` that begins at
    `offsets` and has `into`'s shape, into `into`: one read per contiguous run (a run
    spans the trailing dimensions the part covers whole; a part of rows is one run)."""
    lengths = tuple(into.shape)
    whole = len(lengths)  # the first dimension from which the part covers all that follows
    while whole > 0 and offsets[whole - 1] == 0 and lengths[whole - 1] == saved.shape[whole - 1]:
        whole -= 1
    split = max(whole - 1, 0)  # dimensions before `split` index runs; the run starts at it
    strides = [math.prod(saved.shape[d + 1 :]) for d in range(len(saved.shape))]
    run = lengths[split] * strides[split] if lengths else 1
    same = into.is_contiguous() and into.dtype == saved.dtype and into.device.type == "cpu"
    buffer = into if same else torch.empty(lengths, dtype=saved.dtype)
    raw = buffer.reshape(-1).view(torch.uint8).numpy().data
    size = saved.dtype.itemsize
    position = 0
    for index in itertools.product(*(range(n) for n in lengths[:split])):
        first = sum((offsets[d] + i) * strides[d] for d, i in enumerate(index))
        first += offsets[split] * strides[split] if lengths else 0
        f.seek(start + first * size)
        _read_into(f, raw[position : position + run * size])
        position += run * size
    if buffer is not into:
        into.copy_(buffer)


def _read_into(f: BinaryIO, view: memoryview) -> None:
    while len(view):
        got = f.readinto(view)  # type: ignore[attr-defined]
        if not got:
            raise EOFError(f"{getattr(f, 'name', 'a safetensors file')} ends inside a tensor")
        view = view[got:]


_DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
"""safetensors' dtype names, those a model's weights and buffers are saved in."""


def _header(path: Path) -> Mapping[str, tuple[int, SavedTensor]]:
    """Each tensor in the safetensors file at `path`: its first byte, shape and dtype.
    Read once per process while the file is unchanged (its size and time say); ValueError
    where the header does not describe the file (a name, dtype or range it cannot hold)."""
    stat = path.stat()
    return _read_header(path, size=stat.st_size, modified_ns=stat.st_mtime_ns)


@functools.lru_cache(maxsize=256)
def _read_header(
    path: Path, *, size: int, modified_ns: int
) -> Mapping[str, tuple[int, SavedTensor]]:
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if 8 + length > size:
            raise ValueError(f"{path}: a header of {length} bytes in a file of {size}")
        header = json.loads(f.read(length))
    found: dict[str, tuple[int, SavedTensor]] = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        if entry["dtype"] not in _DTYPES:
            raise ValueError(f"{path}: {key} has dtype {entry['dtype']}")
        tensor = SavedTensor(shape=tuple(entry["shape"]), dtype=_DTYPES[entry["dtype"]])
        first, end = entry["data_offsets"]
        if (
            end - first != math.prod(tensor.shape) * tensor.dtype.itemsize
            or 8 + length + end > size
        ):
            raise ValueError(f"{path}: {key} at bytes {first}-{end} does not fit")
        found[key] = (8 + length + first, tensor)
    return found
