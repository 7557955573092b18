"""`data.kind: tokens`: flat files of token ids, memory-mapped, read as next-token windows.

On disk a token file is little-endian uint16 or uint32 ids, optionally behind llm.c's
header: 256 int32 (1024 bytes) holding HEADER_MAGIC, the version (1: uint16 tokens,
2: uint32) and the number of tokens; the ids follow at byte 1024. A file without the
header is read as `data.token_dtype` (`auto`: uint16). `write_token_file` writes the
header form.

Samples depend on the sequence length T (`model.block_size`), which each call names:
a file of n tokens gives (n - 1) // T windows of T + 1 tokens at stride T (inputs
the first T, targets the last T), so no window crosses from one file into the next.
The windows of all `data.train` files, in order, are the training samples; the
`data.val` files' windows are the held-out set, or without them the last
`data.val_fraction` of the training windows are. `TokenCorpus` builds one
`IndexedCorpus` per T on first use; `token_corpus` builds one directly.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainstack.config import ConfigError, DataConfig
from trainstack.data.indexed import ByLength, EpochOrder, IndexedCorpus
from trainstack.data.sharding import Batch

HEADER_MAGIC = 20240520
"""First int32 of an llm.c token file."""
HEADER_BYTES = 1024
"""The llm.c header: 256 little-endian int32; the tokens start after it."""
HEADER_DTYPES: dict[int, np.dtype] = {1: np.dtype("<u2"), 2: np.dtype("<u4")}
"""Header version -> token dtype."""
RAW_DTYPES: dict[str, np.dtype] = {
    "auto": np.dtype("<u2"),
    "uint16": np.dtype("<u2"),
    "uint32": np.dtype("<u4"),
}
"""`data.token_dtype` -> the dtype of a file without the header."""


@dataclass(kw_only=True)
class TokenFile:
    """One token file: its ids are `count` values of `dtype` from byte `offset`."""

    path: str
    dtype: np.dtype
    offset: int
    """HEADER_BYTES with the llm.c header, else 0."""
    count: int

    @classmethod
    def open(cls, path: str, *, token_dtype: str = "auto", key: str = "data.train") -> TokenFile:
        """Read `path`'s header (nothing else); a file that is not a token file of
        `token_dtype` is a ConfigError naming `key` and the file."""
        where = f"{key} file {path}"
        try:
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                head = f.read(HEADER_BYTES)
        except OSError as e:
            raise ConfigError(f"{where}: cannot be read ({e.strerror or e})") from None
        if size == 0:
            raise ConfigError(f"{where}: the file is empty")
        if len(head) >= 4 and int(np.frombuffer(head[:4], "<i4")[0]) == HEADER_MAGIC:
            return cls._with_header(path, head, size=size, token_dtype=token_dtype, where=where)
        dtype = RAW_DTYPES[token_dtype]
        if size % dtype.itemsize:
            raise ConfigError(
                f"{where}: {size} bytes is not a whole number of {dtype.name} tokens and there "
                f"is no llm.c header (magic {HEADER_MAGIC}); check data.token_dtype"
            )
        return cls(path=path, dtype=dtype, offset=0, count=size // dtype.itemsize)

    @classmethod
    def _with_header(
        cls, path: str, head: bytes, *, size: int, token_dtype: str, where: str
    ) -> TokenFile:
        if len(head) < HEADER_BYTES:
            raise ConfigError(f"{where}: truncated llm.c header ({size} bytes < {HEADER_BYTES})")
        version, count = (int(v) for v in np.frombuffer(head, "<i4")[1:3])
        if version not in HEADER_DTYPES:
            raise ConfigError(
                f"{where}: llm.c header version {version}; allowed: 1 (uint16 tokens) or 2 "
                "(uint32 tokens)"
            )
        dtype = HEADER_DTYPES[version]
        if token_dtype != "auto" and RAW_DTYPES[token_dtype] != dtype:
            raise ConfigError(
                f"{where}: data.token_dtype={token_dtype} but the llm.c header says "
                f"{dtype.name} (version {version}); set data.token_dtype=auto"
            )
        held = (size - HEADER_BYTES) // dtype.itemsize
        if count < 0 or count != held or (size - HEADER_BYTES) % dtype.itemsize:
            raise ConfigError(
                f"{where}: the llm.c header says {count} tokens but the file holds "
                f"{size - HEADER_BYTES} bytes of {dtype.name} after it; the file is damaged"
            )
        return cls(path=path, dtype=dtype, offset=HEADER_BYTES, count=count)

    @functools.cached_property
    def tokens(self) -> np.ndarray:
        """The ids, memory-mapped read-only (nothing is read until indexed)."""
        if self.count == 0:
            return np.zeros(0, dtype=self.dtype)
        return np.memmap(
            self.path, dtype=self.dtype, mode="r", offset=self.offset, shape=(self.count,)
        )

    def windows(self, seq_len: int) -> int:
        """Windows of seq_len + 1 tokens at stride seq_len in this file."""
        return max(0, (self.count - 1) // seq_len)


def write_token_file(path: str | Path, tokens: np.ndarray) -> None:
    """Write `tokens` (1-D non-negative integers) as an llm.c token file, atomically (a
    temporary file in the same directory, renamed into place): uint16 (version 1)
    when every id is below 65536, else uint32 (version 2)."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"tokens of shape {tokens.shape} and dtype {tokens.dtype}: need 1-D ints")
    if len(tokens) >= 2**31:
        raise ValueError(f"{len(tokens)} tokens do not fit the header's int32 count; split them")
    top = int(tokens.max()) if len(tokens) else 0
    if len(tokens) and (int(tokens.min()) < 0 or top >= 2**32):
        raise ValueError(f"token ids must lie in [0, 2**32); got {tokens.min()}..{top}")
    version = 1 if top < 2**16 else 2
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(header_bytes(version=version, count=len(tokens)))
            tokens.astype(HEADER_DTYPES[version], copy=False).tofile(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def header_bytes(*, version: int, count: int) -> bytes:
    """The llm.c header of a file of `count` tokens; version 1: uint16, 2: uint32."""
    assert version in HEADER_DTYPES and 0 <= count < 2**31
    header = np.zeros(HEADER_BYTES // 4, dtype="<i4")
    header[:3] = (HEADER_MAGIC, version, count)
    return header.tobytes()


class TokenWindows:
    """A `SampleSet`: windows first..first+size-1 of the files' windows of seq_len + 1."""

    def __init__(
        self, files: Sequence[TokenFile], *, seq_len: int, first: int = 0, size: int | None = None
    ) -> None:
        self.files = tuple(files)
        self.seq_len = seq_len
        self._ends = np.cumsum([f.windows(seq_len) for f in self.files], dtype=np.int64)
        total = int(self._ends[-1]) if len(self._ends) else 0
        self.first = first
        self.size = total - first if size is None else size
        assert first >= 0 and first + self.size <= total

    def __len__(self) -> int:
        return self.size

    def take(self, ids: np.ndarray, *, seq_len: int) -> Batch:
        """Windows `ids` as next-token pairs: inputs and targets, int64 [len(ids), seq_len]."""
        assert seq_len == self.seq_len, "one TokenWindows per sequence length"
        window = self.first + np.asarray(ids, dtype=np.int64)
        which = np.searchsorted(self._ends, window, side="right")
        starts = (window - np.concatenate([[0], self._ends])[which]) * seq_len
        rows = np.empty((len(window), seq_len + 1), dtype=np.int64)
        for i, (f, start) in enumerate(zip(which.tolist(), starts.tolist(), strict=True)):
            rows[i] = self.files[f].tokens[start : start + seq_len + 1]
        x = torch.from_numpy(rows)
        return x[:, :-1].contiguous(), x[:, 1:].contiguous()


@dataclass(kw_only=True)
class TokenCorpus(ByLength):
    """A `sharding.Corpus` over token files: one `IndexedCorpus` per sequence length."""

    train: tuple[TokenFile, ...]
    val: tuple[TokenFile, ...]
    """Held-out files; empty: the last `val_fraction` of the training windows."""
    val_fraction: float
    seed: int
    shuffle: bool
    given_fingerprint: str = ""
    """The fingerprint to report (e.g. of the text prepared files came from); empty:
    `files_fingerprint` of the files, computed on first use."""
    _by_length: dict[int, IndexedCorpus] = field(default_factory=dict, repr=False)

    @classmethod
    def from_config(cls, cfg: DataConfig) -> TokenCorpus:
        """The corpus of `data.train` / `data.val` (absolute paths: `paths.resolve_data`)."""
        return cls.from_files(cfg.train, cfg.val, cfg=cfg)

    @classmethod
    def from_files(
        cls, train: Sequence[str], val: Sequence[str], *, cfg: DataConfig, fingerprint: str = ""
    ) -> TokenCorpus:
        """A corpus of these token files, split, ordered and typed as `cfg` says; its
        fingerprint is `fingerprint`, else the files' (hashed on first use)."""
        return cls(
            train=tuple(TokenFile.open(p, token_dtype=cfg.token_dtype) for p in train),
            val=tuple(TokenFile.open(p, token_dtype=cfg.token_dtype, key="data.val") for p in val),
            val_fraction=cfg.val_fraction,
            seed=cfg.seed,
            shuffle=cfg.shuffle,
            given_fingerprint=fingerprint,
        )

    @functools.cached_property
    def fingerprint(self) -> str:
        """The given fingerprint, else `files_fingerprint` of the files and the split."""
        if self.given_fingerprint:
            return self.given_fingerprint
        files = {"train": [f.path for f in self.train], "val": [f.path for f in self.val]}
        return files_fingerprint(files, kind="tokens", val_fraction=self.val_fraction)

    def at(self, seq_len: int) -> IndexedCorpus:
        """The training and held-out windows of seq_len + 1 tokens (built once per length)."""
        if seq_len not in self._by_length:
            every = TokenWindows(self.train, seq_len=seq_len)
            if self.val:
                train, held = every, TokenWindows(self.val, seq_len=seq_len)
            else:
                n_held = held_out_size(len(every), self.val_fraction)
                train = TokenWindows(self.train, seq_len=seq_len, size=len(every) - n_held)
                held = TokenWindows(self.train, seq_len=seq_len, first=len(train))
            if len(train) == 0:
                raise ConfigError(
                    f"data.train: {len(every)} windows of model.block_size + 1 = {seq_len + 1} "
                    f"tokens, {len(every) - len(train)} held out (data.val_fraction="
                    f"{self.val_fraction}): none to train on; add data or lower model.block_size"
                )
            self._by_length[seq_len] = IndexedCorpus(
                train=train,
                held_out=held if len(held) else None,
                order=EpochOrder(size=len(train), seed=self.seed, shuffle=self.shuffle),
                fingerprint=self.fingerprint,
            )
        return self._by_length[seq_len]


def token_corpus(
    train: Sequence[str],
    val: Sequence[str],
    *,
    cfg: DataConfig,
    seq_len: int,
    fingerprint: str = "",
) -> IndexedCorpus:
    """The `IndexedCorpus` of windows of seq_len + 1 tokens of these token files, split,
    ordered and typed as `cfg` says; `fingerprint` empty: the files' (hashed now)."""
    return TokenCorpus.from_files(train, val, cfg=cfg, fingerprint=fingerprint).at(seq_len)


def held_out_size(samples: int, val_fraction: float) -> int:
    """Samples `val_fraction` holds out of `samples` (at least one when it is > 0)."""
    return min(samples, math.ceil(samples * val_fraction)) if val_fraction > 0 else 0


_DIGESTS: dict[tuple[str, int, int], str] = {}
"""sha256 of a file's contents by (path, size, mtime_ns): each file hashed once a process."""


def file_digest(path: str) -> str:
    """sha256 of the file's contents, read in chunks (cached while size and mtime hold)."""
    stat = os.stat(path)
    key = (path, stat.st_size, stat.st_mtime_ns)
    if key not in _DIGESTS:
        with open(path, "rb") as f:
            _DIGESTS[key] = hashlib.file_digest(f, "sha256").hexdigest()
    return _DIGESTS[key]


def files_fingerprint(files: Mapping[str, Sequence[str]], **params: Any) -> str:
    """sha256 over `params` and, split by split and in order, every file's (name, size,
    sha256 of its contents): moving the files keeps it, changing a byte changes it."""
    h = hashlib.sha256(json.dumps(params, sort_keys=True, default=str).encode())
    for split, paths in files.items():
        for path in paths:
            entry = [split, Path(path).name, os.path.getsize(path), file_digest(path)]
            h.update(json.dumps(entry).encode())
    return h.hexdigest()
