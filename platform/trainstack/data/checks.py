"""Pre-flight checks of the job's data, on the driver before Ray starts.

`check_data` reads the files (`data.train` / `data.val`, already absolute paths) or
builds your Dataset, and raises `ConfigError` with one line naming the file (or the
target) and the problem: missing, empty or unreadable files; token files with a bad
header or dtype, shorter than one sample, or holding ids >= `data.vocab_size`; arrays
whose lengths, dtypes or labels are wrong; items of the wrong shape; fewer held-out
samples than `data.eval_samples`. It only reads: nothing in your data's folders is
written or deleted. Synthetic sources have nothing to check; `text` files are checked
when `trainstack prepare` reads them (UTF-8, the tokenizer's vocabulary), and the token
files it wrote like any others here.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from trainstack.config import ConfigError, JobConfig
from trainstack.data.arrays import ArrayCorpus, ArrayPart, load_parts
from trainstack.data.custom_dataset import DatasetCorpus, DatasetItems, build_dataset, item_pair
from trainstack.data.tokens import TokenCorpus, TokenFile
from trainstack.kinds import DATA_KINDS, load
from trainstack.user_code import describe_exception

FULL_SCAN_BYTES = 64 * 2**20
"""Token files smaller than this have every id checked against `data.vocab_size`."""
SAMPLE_CHUNKS = 16
"""Larger files: chunks checked, spread evenly from the first token to the last."""
CHUNK_TOKENS = 2**20
"""Tokens in each checked chunk."""
SAMPLE_ITEMS = 8
"""Items of a custom Dataset checked, spread evenly over it."""


def check_data(cfg: JobConfig) -> None:
    """Check the job's data as its source will read it (its kind's `DataKind.data_check`);
    raise ConfigError (one line)."""
    path = DATA_KINDS[cfg.data.kind].data_check
    if path:
        load(path)(cfg)


def check_readable(path: str, *, key: str) -> None:
    """`path` is a non-empty file this process can read."""
    where = f"{key} file {path}"
    if not os.path.exists(path):
        raise ConfigError(f"{where}: no such file")
    if not os.path.isfile(path):
        raise ConfigError(f"{where}: not a regular file")
    try:
        with open(path, "rb") as f:
            first = f.read(1)
    except OSError as e:
        raise ConfigError(f"{where}: cannot be read ({e.strerror or e})") from None
    if not first:
        raise ConfigError(f"{where}: the file is empty")


def check_tokens(cfg: JobConfig) -> None:
    """Token files: headers, lengths, ids below the vocabulary, enough held out."""
    d, block = cfg.data, cfg.model.block_size
    opened: dict[str, list[TokenFile]] = {"data.train": [], "data.val": []}
    for key, paths in (("data.train", d.train), ("data.val", d.val)):
        for path in paths:
            check_readable(path, key=key)
            tokens = TokenFile.open(path, token_dtype=d.token_dtype, key=key)
            check_token_file(tokens, key=key, block_size=block, vocab_size=d.vocab_size)
            opened[key].append(tokens)
    corpus = TokenCorpus(
        train=tuple(opened["data.train"]),
        val=tuple(opened["data.val"]),
        val_fraction=d.val_fraction,
        seed=d.seed,
        shuffle=d.shuffle,
    ).at(block)
    held = len(corpus.held_out) if corpus.held_out is not None else 0
    what = f"windows of model.block_size + 1 = {block + 1} tokens"
    check_held_out(cfg, held=held, what=what)


def check_chat(cfg: JobConfig) -> None:
    """Chat files: every line a conversation the template renders, each fitting
    model.block_size + 1 tokens (or cut, with data.truncate), token ids below the
    vocabulary, enough held out."""
    from trainstack.data.chat import ChatCorpus

    what = f"packed rows of {cfg.model.block_size} tokens" if cfg.data.pack else "conversations"
    _check_chat_like(cfg, ChatCorpus.from_config(cfg.data), what=what)


def _check_chat_like(cfg: JobConfig, corpus: Any, *, what: str) -> None:
    """Files a chat template renders (`ChatCorpus` and its kin): readable, tokenized
    within the vocabulary, enough held out."""
    d = cfg.data
    for key, paths in (("data.train", d.train), ("data.val", d.val)):
        for path in paths:
            check_readable(path, key=key)
    vocab = corpus.tokenizer.vocab_size
    if vocab > d.vocab_size:
        raise ConfigError(
            f"data.tokenizer={d.tokenizer} has {vocab:,} tokens but data.vocab_size="
            f"{d.vocab_size:,}; allowed: data.vocab_size >= {vocab:,} (the model's embedding)"
        )
    samples = corpus.at(cfg.model.block_size)
    held = len(samples.held_out) if samples.held_out is not None else 0
    check_held_out(cfg, held=held, what=what)


def check_preference(cfg: JobConfig) -> None:
    """Preference files: every line a pair whose prompt and answers the template renders,
    each row fitting model.block_size + 1 tokens (or cut, with data.truncate), token ids
    below the vocabulary, enough held out."""
    from trainstack.data.preference import PreferenceCorpus

    _check_chat_like(cfg, PreferenceCorpus.from_config(cfg.data), what="preference pairs")


def check_text(cfg: JobConfig) -> None:
    """A prepared `text` job's token files: a training sample, ids below the vocabulary,
    enough held-out windows."""
    from trainstack.data.text import TextCorpus

    d, block = cfg.data, cfg.model.block_size
    corpus = TextCorpus.from_config(d)
    for key, files in (("data.train", corpus.train), ("data.val", corpus.val)):
        for tokens in files:
            check_token_file(
                tokens, key=f"{key} (prepared)", block_size=block, vocab_size=d.vocab_size
            )
    windows = corpus.at(block)
    held = len(windows.held_out) if windows.held_out is not None else 0
    check_held_out(cfg, held=held, what=f"windows of model.block_size + 1 = {block + 1} tokens")


def check_token_file(tokens: TokenFile, *, key: str, block_size: int, vocab_size: int) -> None:
    """At least one sample of block_size + 1 tokens, and no id >= vocab_size (every id
    of a small file; SAMPLE_CHUNKS chunks of a large one)."""
    where = f"{key} file {tokens.path}"
    if tokens.count < block_size + 1:
        raise ConfigError(
            f"{where}: {tokens.count} tokens, shorter than one sample of model.block_size + 1 "
            f"= {block_size + 1}; use more text per file or lower model.block_size"
        )
    largest, at = largest_token(tokens)
    if largest >= vocab_size:
        raise ConfigError(
            f"{where}: token id {largest} (position {at}) is not below data.vocab_size="
            f"{vocab_size}; set data.vocab_size to the tokenizer's vocabulary (>= {largest + 1})"
        )


def largest_token(tokens: TokenFile) -> tuple[int, int]:
    """The largest id of the file (or of its sampled chunks) and its position."""
    ids = tokens.tokens
    if tokens.count * tokens.dtype.itemsize < FULL_SCAN_BYTES:
        starts = [0]
    else:
        last = tokens.count - CHUNK_TOKENS
        starts = np.linspace(0, last, SAMPLE_CHUNKS).astype(np.int64).tolist()
    best = (-1, 0)
    for start in starts:
        chunk = ids[start : start + (CHUNK_TOKENS if len(starts) > 1 else tokens.count)]
        i = int(np.argmax(chunk))
        best = max(best, (int(chunk[i]), start + i), key=lambda pair: pair[0])
    return best


def check_arrays(cfg: JobConfig) -> None:
    """Arrays: readable parts of matching lengths, labels in [0, num_classes), enough
    held out."""
    d = cfg.data
    keys = {"inputs_key": d.inputs_key, "labels_key": d.labels_key}
    parts: dict[str, list[ArrayPart]] = {}
    for key, paths in (("data.train", d.train), ("data.val", d.val)):
        for path in paths:
            check_readable(path, key=key)
        parts[key] = load_parts(paths, **keys, key=key) if paths else []
        for part in parts[key]:
            check_labels(part, key=key, num_classes=d.num_classes)
    corpus = ArrayCorpus.from_parts(parts["data.train"], parts["data.val"], cfg=d)
    held = len(corpus.held_out) if corpus.held_out is not None else 0
    check_held_out(cfg, held=held, what="rows")


def check_labels(part: ArrayPart, *, key: str, num_classes: int) -> None:
    """Every label of the part lies in [0, num_classes)."""
    low, high = int(np.argmin(part.labels)), int(np.argmax(part.labels))
    for row, hint in ((low, "class ids start at 0"), (high, "raise data.num_classes")):
        label = int(part.labels[row])
        if not 0 <= label < num_classes:
            raise ConfigError(
                f"{key} file {part.where}: label {label} (row {row}) is outside "
                f"[0, data.num_classes={num_classes}); {hint} or fix the labels"
            )


def check_custom(cfg: JobConfig) -> None:
    """Your Dataset: it builds, sampled items fit the task and stack, enough held out."""
    d = cfg.data
    dataset = build_dataset(d)
    where = f"data.target={d.target!r}"
    picks = np.unique(np.linspace(0, len(dataset) - 1, SAMPLE_ITEMS).astype(np.int64))
    for index in picks.tolist():
        try:
            x, y = item_pair(dataset, index)
        except Exception as e:  # the user's __getitem__ raised, or the item is no pair
            raise ConfigError(f"{where}: {_item_error(index, e)}") from None
        problem = item_problem(cfg, x, y)
        if problem:
            raise ConfigError(f"{where}: item {index}: {problem}")
    try:
        DatasetItems(dataset).take(picks, seq_len=cfg.model.block_size)
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None
    corpus = DatasetCorpus.from_dataset(dataset, cfg=d)
    held = len(corpus.held_out) if corpus.held_out is not None else 0
    check_held_out(cfg, held=held, what="items")


def _item_error(index: int, e: Exception) -> str:
    return str(e) if isinstance(e, ValueError) else f"item {index}: {describe_exception(e)}"


INTEGER_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def item_problem(cfg: JobConfig, x: torch.Tensor, y: torch.Tensor) -> str:
    """What is wrong with an item (x, y) for the job's task; empty if nothing."""
    integer = INTEGER_DTYPES
    if cfg.task.kind == "lm":
        block, vocab = cfg.model.block_size, cfg.data.vocab_size
        shape_ok = x.shape == (block,) and y.shape == (block,)
        if not shape_ok or x.dtype not in integer or y.dtype not in integer:
            return (
                f"({_describe(x)}, {_describe(y)}); task.kind=lm needs (ids, next ids), both "
                f"integer [model.block_size] = [{block}]"
            )
        top = int(max(x.max(), y.max()))
        if int(min(x.min(), y.min())) < 0 or top >= vocab:
            return f"token ids outside [0, data.vocab_size={vocab}) (largest {top})"
        return ""
    if not (x.dtype in (*integer, torch.bool) or x.is_floating_point()):
        return f"inputs {_describe(x)}; task.kind=classify needs numbers"
    if y.shape != () or y.dtype not in integer:
        return f"target {_describe(y)}; task.kind=classify needs one integer class id"
    if not 0 <= int(y) < cfg.data.num_classes:
        return f"label {int(y)} is outside [0, data.num_classes={cfg.data.num_classes})"
    return ""


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)}"


def check_held_out(cfg: JobConfig, *, held: int, what: str) -> None:
    """At least `data.eval_samples` held-out samples exist."""
    d = cfg.data
    if d.eval_samples > held:
        source = "data.val" if d.val else f"data.val_fraction={d.val_fraction}"
        raise ConfigError(
            f"data.eval_samples={d.eval_samples} but {source} holds out {held} {what}; set "
            f"data.eval_samples to at most {held} or hold out more data"
        )
