"""`data.kind: arrays`: inputs and class labels from .npz files or pairs of .npy files.

Each listed `.npz` file holds two arrays, `data.inputs_key` (inputs [n, ...], any
numeric dtype) and `data.labels_key` (integer labels [n]). Listed `.npy` files pair up
by folder: `<folder>/<inputs_key>.npy` with `<folder>/<labels_key>.npy`. The parts
(files, or folders of .npy pairs) concatenate in the order listed. `.npy` arrays are
memory-mapped; numpy reads `.npz` members whole. Batches are inputs float32
[b, ...] and labels int64 [b] (`task.kind: classify`). The `data.val` parts are the
held-out set, or without them the last `data.val_fraction` of the training rows.
"""

from __future__ import annotations

import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from trainstack.config import ConfigError, DataConfig
from trainstack.data.indexed import EpochOrder, IndexedCorpus
from trainstack.data.sharding import Batch
from trainstack.data.tokens import files_fingerprint, held_out_size
from trainstack.errors import first_line


@dataclass(frozen=True, kw_only=True)
class ArrayPart:
    """Rows of one .npz file or one folder's .npy pair."""

    where: str
    """The file (or files), for messages."""
    inputs: np.ndarray
    """[n, ...], numeric."""
    labels: np.ndarray
    """[n], integers."""


def load_parts(
    paths: Sequence[str], *, inputs_key: str, labels_key: str, key: str = "data.train"
) -> list[ArrayPart]:
    """The parts `paths` list, in order; a file that is not such a part, or parts that
    disagree on the input shape, is a ConfigError naming `key` and the file."""
    groups: dict[str, dict[str, str]] = {}  # a part's name -> its files, in listed order
    for path in paths:
        p = Path(path)
        if p.suffix == ".npz":
            groups[path] = {"npz": path}
        elif p.suffix == ".npy" and p.stem in (inputs_key, labels_key):
            groups.setdefault(str(p.parent), {})[p.stem] = path
        else:
            raise ConfigError(
                f"{key} file {path}: not an arrays file; allowed: .npz files, or "
                f"{inputs_key}.npy and {labels_key}.npy (data.inputs_key, data.labels_key)"
            )
    keys = {"inputs_key": inputs_key, "labels_key": labels_key, "key": key}
    parts = [
        _npz_part(g["npz"], **keys) if "npz" in g else _npy_part(g, **keys) for g in groups.values()
    ]
    for part in parts[1:]:
        if part.inputs.shape[1:] != parts[0].inputs.shape[1:]:
            raise ConfigError(
                f"{key} file {part.where}: inputs of shape {list(part.inputs.shape[1:])} per row, "
                f"but {parts[0].where} has {list(parts[0].inputs.shape[1:])}; all must agree"
            )
    return parts


def _npz_part(path: str, *, inputs_key: str, labels_key: str, key: str) -> ArrayPart:
    where = f"{key} file {path}"
    if not zipfile.is_zipfile(path):
        raise ConfigError(f"{where}: not a .npz file (no zip archive); write it with numpy.savez")
    try:
        with np.load(path, allow_pickle=False) as members:
            names = list(members.files)
            found = {k: members[k] for k in (inputs_key, labels_key) if k in names}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
        raise ConfigError(f"{where}: cannot be read as .npz ({first_line(e)})") from None
    for k in (inputs_key, labels_key):
        if k not in found:
            raise ConfigError(
                f"{where}: no array {k!r}; it has {sorted(names)} "
                "(set data.inputs_key / data.labels_key)"
            )
    inputs, labels = found[inputs_key], found[labels_key]
    return _checked(path, inputs, labels, key=key)


def _npy_part(pair: dict[str, str], *, inputs_key: str, labels_key: str, key: str) -> ArrayPart:
    for stem in (inputs_key, labels_key):
        if stem not in pair:
            have = next(iter(pair.values()))
            raise ConfigError(
                f"{key} file {have}: no {stem}.npy beside it; list both "
                f"{inputs_key}.npy and {labels_key}.npy of a folder"
            )
    arrays = []
    for stem in (inputs_key, labels_key):
        try:
            arrays.append(np.load(pair[stem], mmap_mode="r", allow_pickle=False))
        except (OSError, ValueError, EOFError) as e:
            raise ConfigError(
                f"{key} file {pair[stem]}: cannot be read as .npy ({first_line(e)})"
            ) from None
    return _checked(f"{pair[inputs_key]} and {labels_key}.npy", *arrays, key=key)


def _checked(where: str, inputs: np.ndarray, labels: np.ndarray, *, key: str) -> ArrayPart:
    """The part, if its inputs are numeric rows and its labels one integer per row."""
    if inputs.dtype.kind not in "biuf" or inputs.ndim < 1:
        raise ConfigError(
            f"{key} file {where}: inputs of dtype {inputs.dtype} and shape {list(inputs.shape)}; "
            "allowed: numbers (bool, int, float) with one row per sample"
        )
    if labels.dtype.kind not in "iu" or labels.ndim != 1:
        raise ConfigError(
            f"{key} file {where}: labels of dtype {labels.dtype} and shape {list(labels.shape)}; "
            "allowed: one integer class id per sample, shape [n]"
        )
    if len(inputs) != len(labels):
        raise ConfigError(
            f"{key} file {where}: {len(inputs)} input rows but {len(labels)} labels; "
            "they must match"
        )
    if len(labels) == 0:
        raise ConfigError(f"{key} file {where}: holds no samples")
    return ArrayPart(where=where, inputs=inputs, labels=labels)


class ArrayRows:
    """A `SampleSet`: rows first..first+size-1 of the parts, concatenated."""

    def __init__(self, parts: Sequence[ArrayPart], *, first: int = 0, size: int | None = None):
        self.parts = tuple(parts)
        self._ends = np.cumsum([len(p.labels) for p in self.parts], dtype=np.int64)
        total = int(self._ends[-1]) if len(self._ends) else 0
        self.first = first
        self.size = total - first if size is None else size
        assert first >= 0 and first + self.size <= total

    def __len__(self) -> int:
        return self.size

    def take(self, ids: np.ndarray, *, seq_len: int) -> Batch:
        """Rows `ids`: inputs float32 [len(ids), ...] and labels int64 [len(ids)]."""
        rows = self.first + np.asarray(ids, dtype=np.int64)
        which = np.searchsorted(self._ends, rows, side="right")
        local = rows - np.concatenate([[0], self._ends])[which]
        inputs = np.empty((len(rows), *self.parts[0].inputs.shape[1:]), dtype=np.float32)
        labels = np.empty(len(rows), dtype=np.int64)
        for part in np.unique(which).tolist():
            mask = which == part
            inputs[mask] = self.parts[part].inputs[local[mask]]
            labels[mask] = self.parts[part].labels[local[mask]]
        return torch.from_numpy(inputs), torch.from_numpy(labels)


class ArrayCorpus(IndexedCorpus):
    """The `IndexedCorpus` of `data.train` / `data.val` arrays."""

    @classmethod
    def from_config(cls, cfg: DataConfig) -> ArrayCorpus:
        """Training and held-out rows as `cfg` says (paths absolute: `paths.resolve_data`)."""
        keys = {"inputs_key": cfg.inputs_key, "labels_key": cfg.labels_key}
        val = load_parts(cfg.val, **keys, key="data.val") if cfg.val else []
        return cls.from_parts(load_parts(cfg.train, **keys), val, cfg=cfg)

    @classmethod
    def from_parts(
        cls, train: Sequence[ArrayPart], val: Sequence[ArrayPart], *, cfg: DataConfig
    ) -> ArrayCorpus:
        """The corpus of loaded parts of `cfg.train` and `cfg.val` (none: `val_fraction`)."""
        every = ArrayRows(train)
        if val and val[0].inputs.shape[1:] != train[0].inputs.shape[1:]:
            raise ConfigError(
                f"data.val file {val[0].where}: inputs of shape {list(val[0].inputs.shape[1:])} "
                f"per row, but data.train has {list(train[0].inputs.shape[1:])}; they must agree"
            )
        if val:
            rows, held = every, ArrayRows(val)
        else:
            n_held = held_out_size(len(every), cfg.val_fraction)
            rows = ArrayRows(train, size=len(every) - n_held)
            held = ArrayRows(train, first=len(rows))
        if len(rows) == 0:
            raise ConfigError(
                f"data.train: all {len(every)} rows are held out by data.val_fraction="
                f"{cfg.val_fraction}; add rows or lower data.val_fraction"
            )
        files = {"train": list(cfg.train), "val": list(cfg.val)}
        keys = {"inputs_key": cfg.inputs_key, "labels_key": cfg.labels_key}
        return cls(
            train=rows,
            held_out=held if len(held) else None,
            order=EpochOrder(size=len(rows), seed=cfg.seed, shuffle=cfg.shuffle),
            fingerprint=files_fingerprint(
                files, kind="arrays", val_fraction=cfg.val_fraction, **keys
            ),
        )
