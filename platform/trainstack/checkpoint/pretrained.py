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
ZeRO-3 partition: one byte range of one file).
"""

from __future__ import annotations

import itertools
import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from trainstack.checkpoint.blocks import as_blocks
from trainstack.checkpoint.sharded import single_process_is_intended

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


def saved_shapes(folder: Path) -> dict[str, list[int]] | None:
    """Each saved tensor's name and shape, from the files' headers; None where the
    folder is not a plain set of safetensors files (`saved_files`) or a header does not
    read (transformers' own loading then says why)."""
    from safetensors import SafetensorError, safe_open

    files = saved_files(folder)
    if files is None:
        return None
    shapes: dict[str, list[int]] = {}
    try:
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    shapes[key] = list(f.get_slice(key).get_shape())
    except (OSError, SafetensorError):
        return None
    return shapes


def read_parts(folder: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Copy each saved tensor named in `tensors` into it, in place (converted to its
    dtype): a DTensor gets its local part only. A collective when distributed: every
    rank calls it, each with its own tensors (a pipeline's ranks hold different keys)."""
    import torch.distributed.checkpoint as dcp

    with single_process_is_intended(), as_blocks(tensors):
        dcp.load(tensors, storage_reader=_slice_reader(folder))


def read_runs(folder: Path, runs: Mapping[str, tuple[int, torch.Tensor]]) -> None:
    """Fill each 1-D tensor of `runs` (a saved name -> (first, into)) with that saved
    tensor's flattened elements from `first` on, converted to its dtype: one contiguous
    byte range of one file each (a ZeRO-3 partition; a whole tensor from 0). Not a
    collective: each rank reads its own runs."""
    files = saved_files(folder)
    assert files is not None, "build_hf_model loads such a folder whole"
    for path in files:
        header = _header(path)
        names = [name for name in runs if name in header]
        if not names:
            continue
        with open(path, "rb", buffering=0) as f:
            for name in names:
                start, saved = header[name]
                first, into = runs[name]
                flat = SavedTensor(shape=(math.prod(saved.shape),), dtype=saved.dtype)
                read_slice(f, start=start, saved=flat, offsets=(first,), into=into)


def _slice_reader(folder: Path) -> Any:
    """A `SliceReader` (defined here: torch.distributed.checkpoint loads on first use)."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    class SliceReader(HuggingFaceStorageReader):
        """DCP's Hugging Face reader, its data read with `read_slice`."""

        def read_data(self, plan: Any, planner: Any) -> torch.futures.Future[None]:
            by_file: dict[str, list[Any]] = {}
            for item in plan.items:
                by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(
                    item
                )
            for path, items in by_file.items():
                offsets = _data_offsets(Path(path))
                with open(path, "rb", buffering=0) as f:
                    for item in items:
                        saved = self.storage_data[item.storage_index]
                        target = planner.resolve_tensor(item).detach()
                        read_slice(
                            f,
                            start=offsets[item.storage_index.fqn],
                            saved=SavedTensor(shape=tuple(saved.shape), dtype=saved.dtype),
                            offsets=tuple(item.storage_offsets),
                            into=target,
                        )
                        planner.commit_tensor(item, target)
            done: torch.futures.Future[None] = torch.futures.Future()
            done.set_result(None)
            return done

    return SliceReader(str(folder))


@dataclass(frozen=True)
class SavedTensor:
    shape: tuple[int, ...]
    dtype: torch.dtype


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


def _data_offsets(path: Path) -> dict[str, int]:
    """Each tensor's first byte in the safetensors file at `path` (its header says)."""
    return {key: start for key, (start, _) in _header(path).items()}


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
}
"""safetensors' dtype names, those a model's weights and buffers are saved in."""


def _header(path: Path) -> dict[str, tuple[int, SavedTensor]]:
    """Each tensor in the safetensors file at `path`: its first byte, shape and dtype."""
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return {
        key: (
            8 + length + entry["data_offsets"][0],
            SavedTensor(shape=tuple(entry["shape"]), dtype=_DTYPES[entry["dtype"]]),
        )
        for key, entry in header.items()
        if key != "__metadata__"
    }
