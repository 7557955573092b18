"""`data.kind: custom`: your own map-style torch Dataset, named by `data.target`.

`target(**data.args)` returns the dataset (anything with `__len__` and
`__getitem__`); item i is a pair `(inputs, target)` of tensors, arrays or numbers.
Items are collated by stacking: floating values become float32, integers and bools
int64. For `task.kind: lm` an item is (ids [T], next ids [T]) with T =
`model.block_size`; for `classify`, (x [...], label). Without your own split the
last `data.val_fraction` of the items are the held-out set; every worker builds the
dataset itself, so `target` must return the same items everywhere.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch

from trainstack.config import ConfigError, DataConfig
from trainstack.data.indexed import EpochOrder, IndexedCorpus
from trainstack.data.sharding import Batch
from trainstack.data.tokens import held_out_size
from trainstack.user_code import call_target, describe_exception


class MapDataset(Protocol):
    """What `data.target` returns: a map-style dataset (a `torch.utils.data.Dataset`)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


def build_dataset(cfg: DataConfig) -> MapDataset:
    """`data.target(**data.args)`; a target that fails or returns something that is not
    a non-empty map-style dataset is one ConfigError line."""
    where = f"data.target={cfg.target!r}"
    dataset = call_target(
        cfg.target, cfg.args, key="data.target", args_key="data.args", makes="a map-style Dataset"
    )
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise ConfigError(
            f"{where} returned a value of type {type(dataset).__name__}, not a map-style Dataset "
            "(one with __len__ and __getitem__); an IterableDataset needs data.kind=ray"
        )
    try:
        size = len(dataset)
    except Exception as e:  # e.g. a Dataset without __len__ of its own
        raise ConfigError(f"{where}: len(dataset) raised {describe_exception(e)}") from None
    if size < 1:
        raise ConfigError(f"{where} returned a dataset of {size} items; need at least 1")
    return dataset


def item_pair(dataset: MapDataset, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Item `index` as two tensors; an item that is not an (inputs, target) pair is a
    ValueError (one line)."""
    item = dataset[index]
    if not isinstance(item, Sequence) or len(item) != 2:
        what = f"a {len(item)}-sequence" if isinstance(item, Sequence) else type(item).__name__
        raise ValueError(f"item {index} is {what}; allowed: a pair (inputs, target)")
    try:
        return _tensor(item[0]), _tensor(item[1])
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"item {index} is not two tensors: {describe_exception(e)}") from None


def _tensor(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    return torch.as_tensor(np.array(value))  # a copy: memory-mapped arrays are read-only


def collate(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """Stacked rows: float32 if floating, else int64."""
    stacked = torch.stack(list(rows))
    return stacked.float() if stacked.is_floating_point() else stacked.long()


class DatasetItems:
    """A `SampleSet`: items first..first+size-1 of a map-style dataset."""

    def __init__(self, dataset: MapDataset, *, first: int = 0, size: int | None = None) -> None:
        self.dataset = dataset
        self.first = first
        self.size = len(dataset) - first if size is None else size
        assert first >= 0 and first + self.size <= len(dataset)

    def __len__(self) -> int:
        return self.size

    def take(self, ids: np.ndarray, *, seq_len: int) -> Batch:
        """Items `ids`, each field stacked (seq_len is the dataset's own business)."""
        pairs = [item_pair(self.dataset, self.first + int(i)) for i in ids]
        try:
            return collate([x for x, _ in pairs]), collate([y for _, y in pairs])
        except RuntimeError as e:  # shapes differ between items
            first = self.first + int(ids[0])
            raise ValueError(
                f"items {first}.. do not stack ({describe_exception(e)}); every "
                "item's inputs must have one shape and every target one shape"
            ) from None


class DatasetCorpus(IndexedCorpus):
    """The `IndexedCorpus` of `data.target`'s dataset."""

    @classmethod
    def from_config(cls, cfg: DataConfig) -> DatasetCorpus:
        """The corpus of `data.target(**data.args)`."""
        return cls.from_dataset(build_dataset(cfg), cfg=cfg)

    @classmethod
    def from_dataset(cls, dataset: MapDataset, *, cfg: DataConfig) -> DatasetCorpus:
        """The dataset's first items for training, the last `data.val_fraction` held out."""
        n_held = held_out_size(len(dataset), cfg.val_fraction)
        train = DatasetItems(dataset, size=len(dataset) - n_held)
        if len(train) == 0:
            raise ConfigError(
                f"data.target: all {len(dataset)} items are held out by data.val_fraction="
                f"{cfg.val_fraction}; return more items or lower data.val_fraction"
            )
        held = DatasetItems(dataset, first=len(train))
        return cls(
            train=train,
            held_out=held if len(held) else None,
            order=EpochOrder(size=len(train), seed=cfg.seed, shuffle=cfg.shuffle),
            fingerprint=dataset_fingerprint(cfg, size=len(dataset)),
        )


def dataset_fingerprint(cfg: DataConfig, *, size: int) -> str:
    """Digest of what names the data: target, args, item count and the split."""
    what = {
        "kind": "custom",
        "target": cfg.target,
        "args": cfg.args,
        "len": size,
        "val_fraction": cfg.val_fraction,
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()
