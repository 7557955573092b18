"""`trainstack prepare SPEC`: tokenize a `data.kind: text` job's files once.

    trainstack prepare jobs/configs/stdlib_gpt.yaml

The result is `<data.prepared_dir>/<fingerprint[:16]>/` holding `train.bin` and
`val.bin` (llm.c token files: each split's files concatenated in order) and
`meta.json`. The fingerprint is a sha256 over the layout version, the tokenizer (its
file's sha256) and every input file's split, path, size and sha256, so the same inputs
always give the same directory, byte for byte.

Preparing is resumable. Under an exclusive lock on `.lock-<fingerprint[:16]>` (a
second `prepare` of the same data waits, then reuses the result), each input file's
tokens go to `.partial-<fingerprint[:16]>/chunks/` as a token file of their own, written
atomically and named by the file's position and content hash; the splits are then
assembled from the chunks, and the directory renamed into place last: a directory with
the final name is complete. A run that was interrupted (Ctrl-C, a crash, a lost node)
leaves its chunks, and the next run tokenizes only the files that have none. Files are
tokenized in file order, in batches of about `BATCH_BYTES` of text that a `tokenizers`
file encodes on every CPU (its own threads, `RAYON_NUM_THREADS` to limit them; the bytes
tokenizer is a copy). Nothing
is written outside `data.prepared_dir`, and a `data.prepared_dir` holding input files
is refused. `data.prepared_dir/inputs/` holds a pointer per input listing, through
which workers find the directory without reading the inputs (`text.prepared_path`).
`ensure_prepared` also caches the job's held-out gzip / xz references there
(`reference-b<block_size>-n<eval_samples>.json`).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, TextIO

import numpy as np

from trainstack.config import ConfigError, DataConfig, JobConfig
from trainstack.data.file_progress import MB, ProgressBar
from trainstack.data.text import (
    FORMAT_VERSION,
    INPUTS_DIR,
    META_FILE,
    TRAIN_FILE,
    VAL_FILE,
    TextTokenizer,
    load_tokenizer,
    read_meta,
    split_files,
    stat_key,
)
from trainstack.data.tokens import (
    HEADER_BYTES,
    HEADER_DTYPES,
    TokenFile,
    file_digest,
    header_bytes,
    write_token_file,
)
from trainstack.files import write_text_atomically

BATCH_BYTES = 16 * 2**20
"""Text per `encode_batch` call: enough for every CPU, small enough that an interrupted
prepare loses little; each batch's files are kept as they finish."""


@dataclass(frozen=True, kw_only=True)
class InputFile:
    split: str
    """`train` or `val`."""
    path: str
    size: int
    sha256: str


@dataclass(frozen=True, kw_only=True)
class Prepared:
    path: Path
    """The complete prepared directory."""
    meta: dict[str, Any]
    reused: bool
    """True when a complete directory with the same fingerprint was there already."""
    resumed: int
    """Input files an interrupted run had tokenized already (their chunks were kept)."""
    seconds: float

    def describe(self) -> str:
        splits = self.meta["splits"]
        files = splits["train"]["files"] + splits["val"]["files"]
        size = (splits["train"]["bytes"] + splits["val"]["bytes"]) / MB
        tokens = splits["train"]["tokens"] + splits["val"]["tokens"]
        what = f"{files} files, {size:,.2f} MB, {tokens:,} tokens"
        if self.reused:
            return f"reusing prepared data {self.path}: {what}"
        speed = size / max(self.seconds, 1e-9)
        again = f" (resumed: {self.resumed} files were done)" if self.resumed else ""
        return f"prepared {what} in {self.seconds:.2f} s, {speed:,.1f} MB/s{again}: {self.path}"


def ensure_prepared(cfg: JobConfig, *, out: TextIO | None = None) -> Path:
    """Prepare a resolved `text` job's files unless done already; compute the held-out
    compression references for its eval windows; return the prepared directory.

    Says what it did on `out` (default stderr), with a progress bar on stderr, unless
    `log.progress` is quiet or jsonl."""
    from trainstack.data.bits_per_byte import reference_bits_per_byte

    chatty = cfg.log.progress not in ("quiet", "jsonl")
    prepared = prepare(cfg.data, progress=sys.stderr if chatty else None)
    if chatty:
        print(f"trainstack: {prepared.describe()}", file=out or sys.stderr, flush=True)
    reference_bits_per_byte(cfg)
    return prepared.path


def prepare(cfg: DataConfig, *, progress: TextIO | None = None) -> Prepared:
    """Tokenize the files of a resolved data section into its prepared directory, or
    reuse the complete one already there; ConfigError for bad input."""
    started = time.perf_counter()
    files = split_files(cfg)
    tokenizer = load_tokenizer(cfg.tokenizer)
    if tokenizer.vocab_size != cfg.vocab_size:
        raise ConfigError(
            f"data.vocab_size={cfg.vocab_size} does not match data.tokenizer="
            f"{cfg.tokenizer}, whose vocabulary has {tokenizer.vocab_size} tokens; set "
            f"data.vocab_size={tokenizer.vocab_size}"
        )
    assert cfg.prepared_dir, "data.paths.resolve_data sets data.prepared_dir"
    root = Path(cfg.prepared_dir)
    inputs = [("train", f) for f in files.train] + [("val", f) for f in files.held_out]
    _refuse_data_directory(root, [path for _, path in inputs])
    bar = ProgressBar(stream=progress, files=len(inputs), total=_total_size(inputs))
    try:
        hashed = hash_inputs(inputs, bar=bar.phase("hashing"))
        fingerprint = input_fingerprint(hashed, tokenizer)
        final = root / fingerprint[:16]
        with _exclusive(root / f".lock-{fingerprint[:16]}", progress=progress):
            reused = (final / META_FILE).is_file()
            if reused:
                _check_complete(final)
            else:
                build = _Build(final=final, inputs=hashed, tokenizer=tokenizer)
                resumed = build.run(fingerprint, bar.phase("tokenizing"))
    finally:
        bar.close()
    write_text_atomically(
        root / INPUTS_DIR / f"{stat_key(cfg)[:16]}.json",
        json.dumps({"directory": final.name, "fingerprint": fingerprint}) + "\n",
    )
    return Prepared(
        path=final,
        meta=read_meta(final),
        reused=reused,
        resumed=0 if reused else resumed,
        seconds=time.perf_counter() - started,
    )


def hash_inputs(inputs: list[tuple[str, str]], *, bar: ProgressBar) -> list[InputFile]:
    """Each input's size and sha256, in order (threads: hashlib releases the GIL)."""

    def one(entry: tuple[str, str]) -> InputFile:
        split, path = entry
        try:
            size, sha256 = os.stat(path).st_size, file_digest(path)
        except OSError as e:
            raise ConfigError(f"data.{split}: cannot read {path}: {e.strerror}") from None
        return InputFile(split=split, path=path, size=size, sha256=sha256)

    hashed = []
    with ThreadPoolExecutor(max_workers=_cpus()) as pool:
        for item in pool.map(one, inputs):
            hashed.append(item)
            bar.advance(item.size)
    return hashed


def input_fingerprint(inputs: list[InputFile], tokenizer: TextTokenizer) -> str:
    """sha256 over the layout version, the tokenizer and each input's split, path, size
    and content hash."""
    listing = {
        "format": FORMAT_VERSION,
        "tokenizer": "bytes" if tokenizer.is_bytes else file_digest(tokenizer.spec),
        "files": [[f.split, f.path, f.size, f.sha256] for f in inputs],
    }
    return hashlib.sha256(json.dumps(listing).encode()).hexdigest()


@dataclass(frozen=True, kw_only=True)
class _Build:
    """Tokenize `inputs` into chunks in the partial directory, assemble the splits, and
    rename the directory to `final`; called with the fingerprint's lock held."""

    final: Path
    inputs: list[InputFile]
    tokenizer: TextTokenizer

    @property
    def partial(self) -> Path:
        return self.final.parent / f".partial-{self.final.name}"

    def chunk(self, index: int) -> Path:
        """Input `index`'s tokens: named by its position and content, so a chunk left by
        an interrupted run is used only for the very same file."""
        return self.partial / "chunks" / f"{index:06d}-{self.inputs[index].sha256[:16]}.bin"

    def run(self, fingerprint: str, bar: ProgressBar) -> int:
        """Build the directory; return how many inputs an earlier run had tokenized."""
        (self.partial / "chunks").mkdir(parents=True, exist_ok=True)
        done = [i for i in range(len(self.inputs)) if self.chunk(i).is_file()]
        for i in done:
            bar.advance(self.inputs[i].size)
        todo = [i for i in range(len(self.inputs)) if i not in set(done)]
        for i in _tokenize_all(self, todo):
            bar.advance(self.inputs[i].size)
        splits = self.assemble()
        meta = {
            "format": FORMAT_VERSION,
            "fingerprint": fingerprint,
            "tokenizer": {
                "name": self.tokenizer.name,
                "sha256": None if self.tokenizer.is_bytes else file_digest(self.tokenizer.spec),
                "vocab_size": self.tokenizer.vocab_size,
            },
            "token_file": {"version": _version(self.tokenizer), "dtype": self.dtype.name},
            "splits": splits,
        }
        (self.partial / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        shutil.rmtree(self.partial / "chunks")
        self.partial.rename(self.final)
        return len(done)

    @property
    def dtype(self) -> np.dtype:
        return HEADER_DTYPES[_version(self.tokenizer)]

    def assemble(self) -> dict[str, dict[str, int]]:
        """train.bin and val.bin: each split's chunks concatenated in input order."""
        splits = {s: {"files": 0, "bytes": 0, "tokens": 0} for s in ("train", "val")}
        with (
            open(self.partial / TRAIN_FILE, "wb") as train,
            open(self.partial / VAL_FILE, "wb") as val,
        ):
            outputs = {"train": train, "val": val}
            for out in outputs.values():
                out.write(b"\0" * HEADER_BYTES)
            for i, item in enumerate(self.inputs):
                tokens = TokenFile.open(str(self.chunk(i))).tokens
                outputs[item.split].write(np.asarray(tokens).astype(self.dtype).tobytes())
                counts = splits[item.split]
                counts["files"] += 1
                counts["bytes"] += item.size
                counts["tokens"] += len(tokens)
            for split, out in outputs.items():
                _finish(
                    out,
                    version=_version(self.tokenizer),
                    count=splits[split]["tokens"],
                    split=split,
                )
        return splits


def _version(tokenizer: TextTokenizer) -> int:
    """The token files' llm.c version: uint16 ids when the vocabulary fits, else uint32."""
    return 1 if tokenizer.vocab_size <= 2**16 else 2


def _tokenize_all(build: _Build, todo: list[int]) -> Iterator[int]:
    """Tokenize the inputs numbered `todo` into their chunks, `BATCH_BYTES` of text at a
    time; yield each number once its chunk is written."""
    batch: list[int] = []
    size = 0
    for i in todo:
        batch.append(i)
        size += build.inputs[i].size
        if size >= BATCH_BYTES:
            yield from _tokenize_batch(build, batch)
            batch, size = [], 0
    yield from _tokenize_batch(build, batch)


def _tokenize_batch(build: _Build, batch: list[int]) -> Iterator[int]:
    if not batch:
        return
    items = [build.inputs[i] for i in batch]
    encoded = build.tokenizer.encode_batch(
        [_read_input(item) for item in items], files=[item.path for item in items]
    )
    for i, tokens in zip(batch, encoded, strict=True):
        write_token_file(build.chunk(i), tokens)
        yield i


def _read_input(item: InputFile) -> bytes:
    """An input's bytes, as hashed: a file that changed since is one ConfigError."""
    try:
        data = Path(item.path).read_bytes()
    except OSError as e:
        raise ConfigError(f"data.{item.split}: cannot read {item.path}: {e.strerror}") from None
    if hashlib.sha256(data).hexdigest() != item.sha256:
        raise ConfigError(f"data.{item.split}: {item.path} changed while preparing")
    return data


def _finish(out: BinaryIO, *, version: int, count: int, split: str) -> None:
    if count >= 2**31:
        raise ConfigError(
            f"data: the {split} split has {count:,} tokens, more than the 2**31 - 1 an "
            "llm.c token file holds; prepare fewer files per job"
        )
    out.seek(0)
    out.write(header_bytes(version=version, count=count))
    out.flush()
    os.fsync(out.fileno())


def _check_complete(directory: Path) -> None:
    """The token files have the sizes meta.json says (a damaged directory is refused)."""
    meta = read_meta(directory)
    itemsize = HEADER_DTYPES[meta["token_file"]["version"]].itemsize
    for split, name in (("train", TRAIN_FILE), ("val", VAL_FILE)):
        want = HEADER_BYTES + itemsize * meta["splits"][split]["tokens"]
        have = (directory / name).stat().st_size if (directory / name).exists() else -1
        if have != want:
            raise ConfigError(
                f"prepared data {directory} is damaged ({name}: {have} bytes, meta.json "
                f"says {want}); delete that directory and prepare again"
            )


@contextmanager
def _exclusive(lock: Path, *, progress: TextIO | None) -> Iterator[None]:
    """Hold an exclusive lock on `lock` (released when the process ends, however)."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if progress is not None:
                print(f"waiting for another prepare of the same data ({lock})", file=progress)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _refuse_data_directory(root: Path, paths: list[str]) -> None:
    for path in paths:
        if Path(path).is_relative_to(root):
            raise ConfigError(
                f"data.prepared_dir={root} holds the input file {path}: prepared files "
                "never go among your data; set data.prepared_dir to another directory"
            )


def _total_size(inputs: list[tuple[str, str]]) -> int:
    return sum(Path(path).stat().st_size for _, path in inputs if Path(path).is_file())


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
