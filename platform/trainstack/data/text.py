"""`data.kind: text`: text files and a tokenizer, read from prepared token files.

Which files: `data.train` minus the held-out ones; held out are the `data.val` files,
else the last `data.val_fraction` of `data.train` by sorted path (at least one file,
rounded up), so the held-out set is a fixed set of files. A pattern may start with
`stdlib:`, a path in the running interpreter's standard library (`stdlib:json/*.py`).

How they become tokens: `data.tokenizer: bytes` takes each file's raw bytes as tokens
(vocabulary 256; any bytes, nothing to decode); a Hugging Face `tokenizers` JSON file
decodes each file as UTF-8 (a file that is not UTF-8 is one `ConfigError` naming the
file and the byte) and encodes it with the tokenizer's own post-processor, without
truncation or padding. `trainstack prepare` (data/prepare.py) writes the tokens once,
every split's files concatenated in order, as llm.c token files under
`data.prepared_dir`; workers only read those (`text_corpus`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trainstack.config import ConfigError, DataConfig
from trainstack.data.indexed import IndexedCorpus
from trainstack.data.tokens import TokenCorpus, TokenFile

STDLIB_PREFIX = "stdlib:"
"""A `data.train` / `data.val` pattern starting with this is relative to the standard
library of the Python that runs trainstack (its `.py` sources ship with every Python)."""

FORMAT_VERSION = 1
"""Of the prepared directory's layout; part of every fingerprint."""
TRAIN_FILE, VAL_FILE, META_FILE = "train.bin", "val.bin", "meta.json"
INPUTS_DIR = "inputs"
"""Under `data.prepared_dir`: one small JSON per input listing (`stat_key`), naming the
prepared directory the driver made for it."""


def stdlib_pattern(pattern: str) -> str:
    """`stdlib:json/*.py` -> `<this interpreter's stdlib>/json/*.py`; others unchanged."""
    if not pattern.startswith(STDLIB_PREFIX):
        return pattern
    return str(Path(sysconfig.get_path("stdlib")) / pattern.removeprefix(STDLIB_PREFIX))


@dataclass(frozen=True, kw_only=True)
class TextFiles:
    """The job's text files by split, each in the order its tokens are concatenated."""

    train: tuple[str, ...]
    held_out: tuple[str, ...]


def split_files(cfg: DataConfig) -> TextFiles:
    """Training and held-out files of a resolved spec (`data.paths.resolve_data`)."""
    if cfg.val:
        held_out = tuple(cfg.val)
        train = tuple(f for f in cfg.train if f not in set(held_out))
    elif cfg.val_fraction > 0:
        ordered = sorted(cfg.train)
        count = max(1, math.ceil(cfg.val_fraction * len(ordered)))
        held_out = tuple(ordered[len(ordered) - count :])
        train = tuple(f for f in cfg.train if f not in set(held_out))
    else:
        held_out, train = (), tuple(cfg.train)
    if not train:
        raise ConfigError(
            f"data.train: no training file is left after holding out {len(held_out)} "
            f"file(s) (data.val / data.val_fraction={cfg.val_fraction}); give data.train "
            "more files or hold out fewer"
        )
    return TextFiles(train=train, held_out=held_out)


@dataclass(frozen=True, kw_only=True)
class TextTokenizer:
    """`bytes`, or a Hugging Face `tokenizers` JSON file, loaded once per process."""

    spec: str
    """`bytes` or the tokenizer file's path."""

    @property
    def is_bytes(self) -> bool:
        return self.spec == "bytes"

    @property
    def name(self) -> str:
        return "bytes" if self.is_bytes else Path(self.spec).name

    @property
    def vocab_size(self) -> int:
        return 256 if self.is_bytes else int(_hf_tokenizer(self.spec).get_vocab_size())

    def encode(self, data: bytes, *, file: str) -> np.ndarray:
        """The tokens of one file's bytes (int64)."""
        return self.encode_batch([data], files=[file])[0]

    def encode_batch(self, texts: list[bytes], *, files: list[str]) -> list[np.ndarray]:
        """The tokens of each file's bytes (int64); a `tokenizers` file encodes them on
        all CPUs (its own threads)."""
        if self.is_bytes:
            return [np.frombuffer(data, dtype=np.uint8).astype(np.int64) for data in texts]
        decoded = [self._text(data, file=file) for data, file in zip(texts, files, strict=True)]
        encodings = _hf_tokenizer(self.spec).encode_batch(decoded)
        return [np.asarray(encoding.ids, dtype=np.int64) for encoding in encodings]

    def encode_with_ends(self, data: bytes, *, file: str) -> tuple[np.ndarray, np.ndarray]:
        """The tokens of `data` and where each ends in it, in bytes (int64, never going
        back). Token k covers the bytes from token k-1's end to its own, so the tokens
        partition the bytes up to the last token's end; a special token covers none."""
        if self.is_bytes:
            return self.encode(data, file=file), np.arange(1, len(data) + 1, dtype=np.int64)
        text = self._text(data, file=file)
        encoding = _hf_tokenizer(self.spec).encode(text)
        char_ends = np.asarray([end for _, end in encoding.offsets], dtype=np.int64)
        ends = (
            np.maximum.accumulate(_byte_offsets(text)[char_ends]) if len(char_ends) else char_ends
        )
        return np.asarray(encoding.ids, dtype=np.int64), ends

    def _text(self, data: bytes, *, file: str) -> str:
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(
                f"{file}: not UTF-8 at byte {e.start} ({e.reason}); data.tokenizer="
                f"{self.spec} reads UTF-8 text: fix the file or use data.tokenizer=bytes"
            ) from None


def _byte_offsets(text: str) -> np.ndarray:
    """Where each character of `text` starts in its UTF-8 bytes, plus the total length."""
    points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    widths = 1 + (points >= 0x80) + (points >= 0x800) + (points >= 0x10000)
    return np.concatenate([[0], np.cumsum(widths, dtype=np.int64)])


def load_tokenizer(spec: str) -> TextTokenizer:
    """The tokenizer `data.tokenizer` names; ConfigError when its file does not load."""
    tokenizer = TextTokenizer(spec=spec)
    if not tokenizer.is_bytes:
        _hf_tokenizer(spec)
    return tokenizer


@functools.cache
def _hf_tokenizer(path: str) -> Any:
    from tokenizers import Tokenizer

    if not Path(path).is_file():
        raise ConfigError(f"data.tokenizer={path}: no such file (from {Path.cwd()})")
    try:
        tokenizer = Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises plain Exceptions with its parser's message
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(
            f"data.tokenizer={path}: not a Hugging Face tokenizers file ({reason}); "
            "give a tokenizer.json saved by tokenizers' Tokenizer.save, or bytes"
        ) from None
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def stat_key(cfg: DataConfig) -> str:
    """A digest of the inputs' paths, sizes and modification times (and the tokenizer's):
    cheap to compute anywhere the files are visible, it changes whenever a file does."""

    def stat(path: str) -> list[Any]:
        info = Path(path).stat()
        return [path, info.st_size, info.st_mtime_ns]

    files = split_files(cfg)
    listing = {
        "format": FORMAT_VERSION,
        "tokenizer": "bytes" if cfg.tokenizer == "bytes" else stat(cfg.tokenizer),
        "train": [stat(f) for f in files.train],
        "held_out": [stat(f) for f in files.held_out],
    }
    return hashlib.sha256(json.dumps(listing).encode()).hexdigest()


def prepared_path(cfg: DataConfig) -> Path:
    """The prepared directory of the spec's inputs as they are now, found through the
    pointer the driver wrote for them (`data.prepare.ensure_prepared`): a worker reads
    no input file. ConfigError when they were not prepared (or changed since)."""
    if not cfg.prepared_dir:
        raise ConfigError("data.prepared_dir is not set: resolve the spec on the driver first")
    try:
        key = stat_key(cfg)
    except OSError as e:
        raise ConfigError(
            f"data.kind=text: cannot see {e.filename} here ({e.strerror}); inputs and "
            "data.prepared_dir must be visible at the same paths on every node"
        ) from None
    pointer = Path(cfg.prepared_dir) / INPUTS_DIR / f"{key[:16]}.json"
    try:
        directory = Path(cfg.prepared_dir) / json.loads(pointer.read_text())["directory"]
    except (OSError, ValueError, KeyError):
        directory = None
    if directory is None or not (directory / META_FILE).is_file():
        raise ConfigError(
            f"data.kind=text: the files of data.train / data.val are not prepared in "
            f"{cfg.prepared_dir} (or changed since): run `trainstack prepare SPEC` "
            "(trainstack run prepares them itself)"
        )
    return directory


def read_meta(directory: Path) -> dict[str, Any]:
    meta: dict[str, Any] = json.loads((directory / META_FILE).read_text())
    return meta


class TextCorpus(TokenCorpus):
    """The prepared `train.bin` / `val.bin` of a `text` job as a `TokenCorpus` (windows of
    seq_len + 1 tokens for each sequence length), fingerprinted by its inputs: meta.json's
    fingerprint of the input files and the tokenizer."""

    @classmethod
    def from_config(cls, cfg: DataConfig) -> TextCorpus:
        directory = prepared_path(cfg)
        meta = read_meta(directory)
        val = (TokenFile.open(str(directory / VAL_FILE)),) if meta["splits"]["val"]["files"] else ()
        return cls(
            train=(TokenFile.open(str(directory / TRAIN_FILE)),),
            val=val,
            val_fraction=0.0,
            seed=cfg.seed,
            shuffle=cfg.shuffle,
            given_fingerprint=meta["fingerprint"],
        )


def text_corpus(cfg: DataConfig, *, seq_len: int) -> IndexedCorpus:
    """The windows of seq_len + 1 tokens of the spec's prepared text."""
    return TextCorpus.from_config(cfg).at(seq_len)
