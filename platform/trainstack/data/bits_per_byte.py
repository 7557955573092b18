"""Held-out bits per byte of a `text` job, and what gzip -9 and xz -9 get on the same bytes.

Which bytes: evaluation reads the first `data.eval_samples` (n) held-out windows of
`model.block_size + 1` (T + 1) tokens, with stride T, from `val.bin` (the held-out
files' tokens concatenated in order), and scores each window's last T tokens. Those
targets are held-out tokens 1..nT, each exactly once. Token k covers the bytes from
where token k-1 ends to where it ends (`TextTokenizer.encode_with_ends`), so the eval
bytes are the held-out files' concatenated bytes from the end of token 0 to the end of
token nT; with the bytes tokenizer, bytes 1..nT. The model's figure is

    eval_bits_per_byte = eval_loss (nats per token) × nT / len(eval bytes) / ln 2

and the references are `gzip.compress(eval bytes, 9)` (= `gzip -9 -n`) and
`lzma.compress(eval bytes, preset=9)` (= `xz -9`), 8 × compressed size / len(eval
bytes). The driver computes them once per (T, n) and caches them next to the token
files as `reference-b<T>-n<n>.json`.
"""

from __future__ import annotations

import gzip
import json
import lzma
import math
from pathlib import Path

import numpy as np

from trainstack.config import ConfigError, JobConfig
from trainstack.data.text import load_tokenizer, prepared_path, split_files, text_corpus
from trainstack.files import write_text_atomically
from trainstack.kinds import data_kind_of


def bits_per_byte(nats_per_token: float, *, tokens: int, num_bytes: int) -> float:
    """Mean cross-entropy in nats per token as bits per byte of the text they cover."""
    return nats_per_token * tokens / num_bytes / math.log(2)


def compressed_bits_per_byte(data: bytes) -> dict[str, float]:
    """Bits per byte of `data` compressed by gzip -9 and xz -9 (headers included)."""
    bits = 8 / len(data)
    return {
        "gzip_bits_per_byte": len(gzip.compress(data, compresslevel=9, mtime=0)) * bits,
        "xz_bits_per_byte": len(lzma.compress(data, preset=9)) * bits,
    }


def summary_bits_per_byte(cfg: JobConfig, eval_loss: float | None) -> dict[str, float]:
    """The summary's `eval_bits_per_byte` and its references (`reference_bits_per_byte`);
    empty for a job that is not `text` or has no held-out loss."""
    if not data_kind_of(cfg).prepared or eval_loss is None or not cfg.data.eval_samples:
        return {}
    refs = reference_bits_per_byte(cfg)
    model = bits_per_byte(
        eval_loss, tokens=int(refs["eval_tokens"]), num_bytes=int(refs["eval_bytes"])
    )
    return {"eval_bits_per_byte": model, **refs}


def reference_bits_per_byte(cfg: JobConfig) -> dict[str, float]:
    """`gzip_bits_per_byte` and `xz_bits_per_byte` on the job's held-out eval bytes, and
    their counts (`eval_bytes`, `eval_tokens`); read from the prepared directory's cache,
    computed (from the input files) and cached there the first time. Empty without eval."""
    if not data_kind_of(cfg).prepared or not cfg.data.eval_samples:
        return {}
    seq_len, count = cfg.model.block_size, cfg.data.eval_samples
    cache = prepared_path(cfg.data) / f"reference-b{seq_len}-n{count}.json"
    if cache.is_file():
        cached: dict[str, float] = json.loads(cache.read_text())
        return cached
    data, tokens = held_out_eval_bytes(cfg)
    refs = {"eval_bytes": len(data), "eval_tokens": tokens, **compressed_bits_per_byte(data)}
    write_text_atomically(cache, json.dumps(refs, indent=2, sort_keys=True) + "\n")
    return refs


def held_out_eval_bytes(cfg: JobConfig) -> tuple[bytes, int]:
    """The bytes the job's held-out evaluation scores, and how many tokens cover them.

    The targets come from the corpus the workers build (`text.text_corpus`); the bytes
    from re-tokenizing the held-out files, whose first tokens must be those targets."""
    seq_len, count = cfg.model.block_size, cfg.data.eval_samples
    corpus = text_corpus(cfg.data, seq_len=seq_len)
    available = len(corpus.held_out) if corpus.held_out is not None else 0
    if count > available:
        raise ConfigError(
            f"data.eval_samples={count} is more than the {available} held-out windows of "
            f"model.block_size + 1 = {seq_len + 1} tokens the held-out files hold; lower "
            "data.eval_samples or hold out more text (data.val / data.val_fraction)"
        )
    targets = corpus.held_out_batch(count, seq_len=seq_len)[1].numpy().reshape(-1)
    needed = len(targets) + 1
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    ids: list[np.ndarray] = []
    ends: list[np.ndarray] = []
    chunks: list[bytes] = []
    offset = 0
    for path in split_files(cfg.data).held_out:
        if sum(len(i) for i in ids) >= needed:
            break
        data = Path(path).read_bytes()
        file_ids, file_ends = tokenizer.encode_with_ends(data, file=path)
        ids.append(file_ids)
        ends.append(file_ends + offset)
        chunks.append(data)
        offset += len(data)
    all_ids, all_ends = np.concatenate(ids)[:needed], np.concatenate(ends)[:needed]
    all_ends = np.maximum.accumulate(all_ends)
    assert np.array_equal(all_ids[1:], targets), "eval targets are held-out tokens 1..nT"
    text = b"".join(chunks)
    return text[int(all_ends[0]) : int(all_ends[-1])], len(targets)
