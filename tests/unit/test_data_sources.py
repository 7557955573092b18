"""Your data as trainstack reads it: token files, arrays and your own Dataset, their
fingerprints, and every kind of bad data as one ConfigError line from pre-flight."""

from __future__ import annotations

import os
import re
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from trainstack.config import ConfigError, JobConfig, config_from_dict
from trainstack.data import (
    ArrayCorpus,
    ClustersCorpus,
    DatasetCorpus,
    IndexedCorpus,
    MarkovCorpus,
    TokenCorpus,
    build_corpus,
)
from trainstack.data import checks as checks_module
from trainstack.data import tokens as tokens_module
from trainstack.data.arrays import ArrayRows
from trainstack.data.checks import check_data
from trainstack.data.paths import resolve_data
from trainstack.data.tokens import HEADER_BYTES, TokenFile, token_corpus, write_token_file

T = 4
"""model.block_size of the lm tests: windows of 5 tokens at stride 4."""


def lm_job(**data: Any) -> JobConfig:
    raw = {"data": {"kind": "tokens", "eval_samples": 0, **data}, "model": {"block_size": T}}
    return resolve_data(config_from_dict(raw))


def classify_job(**data: Any) -> JobConfig:
    raw = {
        "data": {"eval_samples": 0, "num_classes": 4, **data},
        "model": {"kind": "custom", "target": "user_models.cnn:build"},
        "task": {"kind": "classify"},
    }
    return resolve_data(config_from_dict(raw))


def one_line_error(cfg: JobConfig, pattern: str) -> str:
    with pytest.raises(ConfigError) as e:
        check_data(cfg)
    message = str(e.value)
    assert "\n" not in message
    assert re.search(pattern, message), message
    return message


def rows_of(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Windows x[0..T] back from (inputs, targets)."""
    x, y = batch
    assert torch.equal(x[:, 1:], y[:, :-1]) and x.dtype == y.dtype == torch.int64
    return torch.cat([x, y[:, -1:]], dim=1)


# ---- tokens ------------------------------------------------------------------------


@pytest.mark.parametrize("top", [63, 70_000])
def test_token_files_round_trip_with_the_llm_c_header(tmp_path: Path, top: int) -> None:
    ids = np.linspace(0, top, 50).astype(np.int64)
    write_token_file(tmp_path / "a.bin", ids)
    assert os.listdir(tmp_path) == ["a.bin"]  # written atomically: no temporary left
    raw = (tmp_path / "a.bin").read_bytes()
    assert np.frombuffer(raw[:12], "<i4").tolist() == [20240520, 1 if top < 2**16 else 2, 50]
    tf = TokenFile.open(str(tmp_path / "a.bin"))
    assert (tf.offset, tf.count, tf.dtype.itemsize) == (HEADER_BYTES, 50, 2 if top < 2**16 else 4)
    assert isinstance(tf.tokens, np.memmap) and tf.tokens.tolist() == ids.tolist()


def test_a_vocabulary_past_uint16_trains_from_uint32_files(tmp_path: Path) -> None:
    ids = np.arange(0, 128_000, 1000, dtype=np.int64)  # ids up to 127,000: uint32 on disk
    write_token_file(tmp_path / "big.bin", ids)
    cfg = lm_job(train=[str(tmp_path / "big.bin")], vocab_size=128_256)
    check_data(cfg)  # every id below the vocabulary
    corpus = token_corpus(cfg.data.train, (), cfg=cfg.data, seq_len=T)
    x, y = corpus.train_batch(0, 2, seq_len=T)
    assert int(torch.cat([x, y]).max()) >= 2**16
    one_line_error(lm_job(train=[str(tmp_path / "big.bin")], vocab_size=100_000), "127000")


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_raw_token_files_use_the_token_dtype(tmp_path: Path, dtype: str) -> None:
    ids = np.arange(41, dtype=dtype) % 64
    ids.tofile(tmp_path / "raw.bin")
    token_dtype = "auto" if dtype == "uint16" else dtype
    cfg = lm_job(train=[str(tmp_path / "raw.bin")], token_dtype=token_dtype)
    check_data(cfg)
    corpus = token_corpus(cfg.data.train, [], cfg=cfg.data, seq_len=T)
    assert len(corpus.train) == 10
    rows = rows_of(corpus.train.take(np.arange(10), seq_len=T))
    assert rows.tolist() == [list(range(4 * j, 4 * j + 5)) for j in range(10)]


def test_windows_of_several_files_never_cross_a_file_boundary(tmp_path: Path) -> None:
    sizes = [23, 9, 5, 17]  # 5, 2, 1 and 4 windows of T + 1 = 5 tokens
    for k, n in enumerate(sizes):
        write_token_file(tmp_path / f"part{k}.bin", 100 * k + np.arange(n))
    files = [str(tmp_path / f"part{k}.bin") for k in range(len(sizes))]
    corpus = build_corpus(lm_job(train=files, shuffle=False).data)
    assert isinstance(corpus, TokenCorpus) and len(corpus.at(T).train) == 12
    rows = rows_of(corpus.train_batch(0, 12, seq_len=T))
    expected = [
        [100 * k + s + i for i in range(T + 1)]
        for k, n in enumerate(sizes)
        for s in range(0, (n - 1) // T * T, T)
    ]
    assert rows.tolist() == expected
    # Another sequence length is another set of windows, built on first use.
    assert len(corpus.at(8).train) == sum((n - 1) // 8 for n in sizes) == 5


def test_val_files_are_the_held_out_set(tmp_path: Path) -> None:
    write_token_file(tmp_path / "train.bin", np.arange(41) % 64)
    write_token_file(tmp_path / "val.bin", 50 + np.arange(13) % 10)
    cfg = lm_job(train=[str(tmp_path / "train.bin")], val=[str(tmp_path / "val.bin")])
    corpus = build_corpus(cfg.data)
    assert len(corpus.at(T).train) == 10 and corpus.at(T).held_out is not None
    held = rows_of(corpus.held_out_batch(3, seq_len=T))
    assert held.tolist() == [[50 + (s + i) % 10 for i in range(5)] for s in (0, 4, 8)]


def test_val_fraction_holds_out_the_last_training_windows(tmp_path: Path) -> None:
    write_token_file(tmp_path / "a.bin", np.arange(41) % 64)  # 10 windows
    cfg = lm_job(train=[str(tmp_path / "a.bin")], val_fraction=0.25, eval_samples=3)
    check_data(cfg)
    corpus = build_corpus(cfg.data)
    assert len(corpus.at(T).train) == 7  # ceil(10 * 0.25) = 3 held out
    seen = rows_of(corpus.train_batch(0, 7 * 3, seq_len=T))[:, 0].unique().tolist()
    assert seen == [0, 4, 8, 12, 16, 20, 24]  # three epochs, never a held-out window
    assert rows_of(corpus.held_out_batch(3, seq_len=T))[:, 0].tolist() == [28, 32, 36]


# ---- arrays ------------------------------------------------------------------------


def digits_like(n: int, *, seed: int, offset: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    inputs = rng.integers(0, 17, size=(n, 1, 2, 2)).astype(np.float64)
    inputs[:, 0, 0, 0] = offset + np.arange(n)  # row i is recognisable
    return inputs, rng.integers(0, 4, size=n)


def test_npz_files_concatenate_in_order(tmp_path: Path) -> None:
    (x1, y1), (x2, y2) = digits_like(5, seed=1), digits_like(3, seed=2, offset=5)
    np.savez(tmp_path / "a.npz", inputs=x1, labels=y1)
    np.savez(tmp_path / "b.npz", inputs=x2, labels=y2)
    cfg = classify_job(kind="arrays", train=[str(tmp_path / "*.npz")], shuffle=False)
    check_data(cfg)
    corpus = build_corpus(cfg.data)
    assert isinstance(corpus, ArrayCorpus) and len(corpus.train) == 8
    x, y = corpus.train_batch(0, 8, seq_len=T)
    assert x.dtype == torch.float32 and y.dtype == torch.int64 and x.shape == (8, 1, 2, 2)
    assert torch.equal(x, torch.from_numpy(np.concatenate([x1, x2])).float())
    assert y.tolist() == [*y1.tolist(), *y2.tolist()]


def test_npy_pairs_are_memory_mapped_and_val_fraction_holds_out_the_last_rows(
    tmp_path: Path,
) -> None:
    x, y = digits_like(10, seed=3)
    np.save(tmp_path / "pixels.npy", x.astype(np.uint8))
    np.save(tmp_path / "classes.npy", y.astype(np.int32))
    cfg = classify_job(
        kind="arrays",
        train=[str(tmp_path / "*.npy")],
        inputs_key="pixels",
        labels_key="classes",
        val_fraction=0.2,
        eval_samples=2,
    )
    check_data(cfg)
    corpus = build_corpus(cfg.data)
    assert isinstance(corpus, ArrayCorpus) and len(corpus.train) == 8
    assert isinstance(corpus.train, ArrayRows)
    assert all(isinstance(p.inputs, np.memmap) for p in corpus.train.parts)
    hx, hy = corpus.held_out_batch(2, seq_len=T)
    assert hx[:, 0, 0, 0].tolist() == [8.0, 9.0] and hy.tolist() == y[8:].tolist()
    ids = corpus.train_batch(0, 16, seq_len=T)[0][:, 0, 0, 0]
    assert sorted(ids.tolist()) == sorted(2 * list(range(8)))  # two epochs of the 8


# ---- your own Dataset --------------------------------------------------------------

DATASETS = """
import torch

class Rows(torch.utils.data.Dataset):
    def __init__(self, n=10, dim=3):
        self.n, self.dim = n, dim
    def __len__(self):
        return self.n
    def __getitem__(self, i):
        return torch.full((self.dim,), float(i)), i % 4

class Windows:
    def __init__(self, n=12, block=4):
        self.n, self.block = n, block
    def __len__(self):
        return self.n
    def __getitem__(self, i):
        ids = torch.arange(i, i + self.block + 1) % 50
        return ids[: self.block], ids[1 : self.block + 1]

class Ragged(Rows):
    def __getitem__(self, i):
        return torch.zeros(1 + i % 2), 0

class Triples(Rows):
    def __getitem__(self, i):
        return 1.0, 2, 3

class Failing(Rows):
    def __getitem__(self, i):
        raise KeyError(i)

def broken(**args):
    raise RuntimeError("the data server is down")

def not_a_dataset():
    return 5
"""


@pytest.fixture(scope="module", autouse=True)
def datasets_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    folder = tmp_path_factory.mktemp("user-datasets")
    (folder / "my_datasets.py").write_text(textwrap.dedent(DATASETS))
    sys.path.insert(0, str(folder))
    yield
    sys.path.remove(str(folder))
    sys.modules.pop("my_datasets", None)


def test_a_custom_dataset_serves_classify_items_and_holds_out_the_last() -> None:
    cfg = classify_job(
        kind="custom", target="my_datasets:Rows", args={"n": 10}, val_fraction=0.3, eval_samples=3
    )
    check_data(cfg)
    corpus = build_corpus(cfg.data)
    assert isinstance(corpus, DatasetCorpus) and len(corpus.train) == 7
    x, y = corpus.held_out_batch(3, seq_len=T)
    assert x.dtype == torch.float32 and x[:, 0].tolist() == [7.0, 8.0, 9.0]
    assert y.dtype == torch.int64 and y.tolist() == [3, 0, 1]


def test_a_custom_dataset_serves_lm_windows() -> None:
    raw = {
        "data": {
            "kind": "custom",
            "target": "my_datasets:Windows",
            "val_fraction": 0.25,
            "eval_samples": 3,
        },
        "model": {"block_size": T},
    }
    cfg = config_from_dict(raw)
    check_data(cfg)
    corpus = build_corpus(cfg.data)
    assert isinstance(corpus, IndexedCorpus)
    rows = rows_of(corpus.train_batch(0, 9, seq_len=T))
    assert sorted(rows[:, 0].tolist()) == list(range(9))


# ---- fingerprints ------------------------------------------------------------------


def test_file_fingerprints_follow_the_contents_not_the_folder(tmp_path: Path) -> None:
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        write_token_file(tmp_path / folder / "x.bin", np.arange(41) % 64)
        write_token_file(tmp_path / folder / "y.bin", np.arange(17) % 64)

    def fingerprint(*names: str, **data: Any) -> str:
        corpus = build_corpus(lm_job(train=[str(tmp_path / n) for n in names], **data).data)
        return corpus.fingerprint

    same = fingerprint("a/x.bin", "a/y.bin")
    assert same == fingerprint("b/x.bin", "b/y.bin")
    assert same != fingerprint("a/y.bin", "a/x.bin")  # another order is another stream
    assert same != fingerprint("a/x.bin", "a/y.bin", val_fraction=0.1)

    data = bytearray((tmp_path / "b/y.bin").read_bytes())
    data[HEADER_BYTES + 3] ^= 1  # one bit of one token
    (tmp_path / "b/y.bin").write_bytes(bytes(data))
    tokens_module._DIGESTS.clear()  # a new process: nothing hashed yet
    assert fingerprint("b/x.bin", "b/y.bin") != same


def test_synthetic_and_custom_fingerprints_follow_their_parameters() -> None:
    markov = MarkovCorpus(vocab_size=8, order=1, concentration=0.3, seed=1)
    assert (
        markov.fingerprint
        == MarkovCorpus(vocab_size=8, order=1, concentration=0.3, seed=1).fingerprint
    )
    assert (
        markov.fingerprint
        != MarkovCorpus(vocab_size=8, order=1, concentration=0.3, seed=2).fingerprint
    )
    uniform = MarkovCorpus.from_transitions(np.full((4, 4), 0.25), order=1)
    skewed = MarkovCorpus.from_transitions(np.eye(4)[[1, 2, 3, 0]], order=1)
    assert uniform.fingerprint != skewed.fingerprint

    def clusters(**kw: Any) -> str:
        args = {"num_classes": 4, "shape": (3,), "noise": 1.0, "seed": 0, "eval_samples": 8}
        return ClustersCorpus(**{**args, **kw}).fingerprint

    assert clusters() == clusters(eval_samples=64) != clusters(noise=0.5)

    def custom(**args: Any) -> str:
        return build_corpus(
            classify_job(kind="custom", target="my_datasets:Rows", args=args).data
        ).fingerprint

    assert custom(n=10) == custom(n=10) != custom(n=11)


# ---- bad data: one line each -------------------------------------------------------


def token_file(tmp_path: Path, ids: Any, *, header: bool = True, name: str = "a.bin") -> str:
    path = tmp_path / name
    if header:
        write_token_file(path, np.asarray(ids))
    else:
        np.asarray(ids, dtype=np.uint16).tofile(path)
    return str(path)


def with_header(tmp_path: Path, *, version: int, count: int, payload: bytes) -> str:
    header = np.zeros(256, "<i4")
    header[:3] = (20240520, version, count)
    (tmp_path / "h.bin").write_bytes(header.tobytes() + payload)
    return str(tmp_path / "h.bin")


BAD_TOKENS: dict[str, tuple[Callable[[Path], dict[str, Any]], str]] = {
    "missing": (lambda p: {"train": [str(p / "gone.bin")]}, r"gone\.bin: no such file"),
    "empty": (lambda p: {"train": [str(p / "e.bin")]}, r"e\.bin: the file is empty"),
    "folder": (lambda p: {"train": [str(p)]}, r"not a regular file"),
    "short": (
        lambda p: {"train": [token_file(p, [1, 2, 3, 4])]},
        r"a\.bin: 4 tokens, shorter than one sample of model\.block_size \+ 1 = 5",
    ),
    "id too large": (
        lambda p: {"train": [token_file(p, [1] * 30 + [64] + [2] * 9)]},
        r"a\.bin: token id 64 \(position 30\) is not below data\.vocab_size=64",
    ),
    "val id too large": (
        lambda p: {"train": [token_file(p, [1] * 9)], "val": [token_file(p, [99] * 9, name="v")]},
        r"data\.val file .*v: token id 99",
    ),
    "odd raw size": (
        lambda p: {"train": [token_file(p, [1] * 9, header=False)], "token_dtype": "uint32"},
        r"18 bytes is not a whole number of uint32 tokens",
    ),
    "header version": (
        lambda p: {"train": [with_header(p, version=7, count=2, payload=b"\0" * 4)]},
        r"llm\.c header version 7; allowed: 1 \(uint16 tokens\) or 2",
    ),
    "header count": (
        lambda p: {"train": [with_header(p, version=1, count=9, payload=b"\0" * 6)]},
        r"h\.bin: the llm\.c header says 9 tokens but the file holds 6 bytes",
    ),
    "dtype against header": (
        lambda p: {"train": [token_file(p, [1] * 9)], "token_dtype": "uint32"},
        r"data\.token_dtype=uint32 but the llm\.c header says uint16",
    ),
    "too few held out": (
        lambda p: {"train": [token_file(p, [1] * 41)], "val_fraction": 0.1, "eval_samples": 5},
        r"data\.eval_samples=5 but data\.val_fraction=0\.1 holds out 1 windows of "
        r"model\.block_size \+ 1 = 5 tokens; set data\.eval_samples to at most 1",
    ),
}


@pytest.mark.parametrize("case", list(BAD_TOKENS))
def test_bad_token_data_is_one_line(tmp_path: Path, case: str) -> None:
    (tmp_path / "e.bin").touch()
    make, pattern = BAD_TOKENS[case]
    data = make(tmp_path)
    raw = {"data": {"kind": "tokens", "eval_samples": 0, **data}, "model": {"block_size": T}}
    one_line_error(config_from_dict(raw), pattern)  # paths as the driver resolved them


def test_a_truncated_header_is_one_line(tmp_path: Path) -> None:
    header = np.zeros(100, "<i4")
    header[:3] = (20240520, 1, 9)
    (tmp_path / "t.bin").write_bytes(header.tobytes())
    one_line_error(lm_job(train=[str(tmp_path / "t.bin")]), r"truncated llm\.c header")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_an_unreadable_file_is_one_line(tmp_path: Path) -> None:
    path = token_file(tmp_path, [1] * 9)
    os.chmod(path, 0)
    one_line_error(lm_job(train=[path]), r"a\.bin: cannot be read \(Permission denied\)")


def test_a_file_the_driver_may_not_read_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = token_file(tmp_path, [1] * 9)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(checks_module, "open", refuse, raising=False)  # as any user but root
    one_line_error(lm_job(train=[path]), r"a\.bin: cannot be read \(Permission denied\)")


def test_large_token_files_are_checked_in_chunks_that_reach_both_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(checks_module, "FULL_SCAN_BYTES", 0)
    monkeypatch.setattr(checks_module, "CHUNK_TOKENS", 16)
    path = token_file(tmp_path, [1] * 999 + [70])
    one_line_error(lm_job(train=[path]), r"token id 70 \(position 999\)")


def arrays(tmp_path: Path, name: str = "a.npz", **members: Any) -> str:
    x, y = digits_like(6, seed=0)
    np.savez(tmp_path / name, **{"inputs": x, "labels": y, **members})
    return str(tmp_path / name)


BAD_ARRAYS: dict[str, tuple[Callable[[Path], dict[str, Any]], str]] = {
    "lengths": (
        lambda p: {"train": [arrays(p, labels=np.zeros(5, int))]},
        r"a\.npz: 6 input rows but 5 labels; they must match",
    ),
    "label too large": (
        lambda p: {"train": [arrays(p, labels=np.array([0, 1, 2, 3, 4, 0]))]},
        r"a\.npz: label 4 \(row 4\) is outside \[0, data\.num_classes=4\); raise data\.num_classes",
    ),
    "negative label": (
        lambda p: {"train": [arrays(p, labels=np.array([0, 1, -1, 3, 1, 0]))]},
        r"label -1 \(row 2\) is outside \[0, data\.num_classes=4\); class ids start at 0",
    ),
    "float labels": (
        lambda p: {"train": [arrays(p, labels=np.zeros(6))]},
        r"labels of dtype float64 and shape \[6\]; allowed: one integer class id",
    ),
    "text inputs": (
        lambda p: {"train": [arrays(p, inputs=np.array(list("abcdef")))]},
        r"inputs of dtype <U1 and shape \[6\]; allowed: numbers",
    ),
    "missing key": (
        lambda p: {"train": [arrays(p)], "labels_key": "y"},
        r"a\.npz: no array 'y'; it has \['inputs', 'labels'\]",
    ),
    "not npz": (
        lambda p: {"train": [token_file(p, [1] * 9, name="x.npz")]},
        r"x\.npz: not a \.npz file \(no zip archive\); write it with numpy\.savez",
    ),
    "object arrays": (
        lambda p: {"train": [arrays(p, inputs=np.array([None] * 6))]},
        r"a\.npz: cannot be read as \.npz \(Object arrays cannot be loaded",
    ),
    "other file": (
        lambda p: {"train": [token_file(p, [1] * 9, name="x.csv")]},
        r"x\.csv: not an arrays file; allowed: \.npz files, or inputs\.npy and labels\.npy",
    ),
    "npy without partner": (
        lambda p: {"train": [str(p / "inputs.npy")]},
        r"inputs\.npy: no labels\.npy beside it",
    ),
    "shapes disagree": (
        lambda p: {"train": [arrays(p), arrays(p, "b.npz", inputs=np.zeros((6, 3)))]},
        r"b\.npz: inputs of shape \[3\] per row, but .*a\.npz has \[1, 2, 2\]",
    ),
    "val shape": (
        lambda p: {"train": [arrays(p)], "val": [arrays(p, "v.npz", inputs=np.zeros((6, 4)))]},
        r"data\.val file .*v\.npz: inputs of shape \[4\] per row, but data\.train has \[1, 2, 2\]",
    ),
    "too few held out": (
        lambda p: {"train": [arrays(p)], "val": [arrays(p, "v.npz")], "eval_samples": 7},
        r"data\.eval_samples=7 but data\.val holds out 6 rows; set data\.eval_samples to at most 6",
    ),
}


@pytest.mark.parametrize("case", list(BAD_ARRAYS))
def test_bad_arrays_are_one_line(tmp_path: Path, case: str) -> None:
    np.save(tmp_path / "inputs.npy", np.zeros((3, 2)))
    make, pattern = BAD_ARRAYS[case]
    one_line_error(classify_job(kind="arrays", **make(tmp_path)), pattern)


BAD_DATASETS: dict[str, tuple[dict[str, Any], str]] = {
    "raises": (
        {"target": "my_datasets:broken", "args": {"n": 3}},
        r"data\.target='my_datasets:broken' raised RuntimeError: the data server is down "
        r"when called with data\.args=\{'n': 3\}",
    ),
    "not a dataset": (
        {"target": "my_datasets:not_a_dataset"},
        r"returned a value of type int, not a map-style Dataset \(one with __len__ and "
        r"__getitem__\)",
    ),
    "empty": ({"target": "my_datasets:Rows", "args": {"n": 0}}, r"a dataset of 0 items"),
    "item raises": ({"target": "my_datasets:Failing"}, r"item 0: KeyError: 0"),
    "triples": ({"target": "my_datasets:Triples"}, r"item 0 is a 3-sequence; allowed: a pair"),
    "ragged": ({"target": "my_datasets:Ragged"}, r"items 0\.\. do not stack"),
    "label too large": (
        {"target": "my_datasets:Rows", "num_classes": 3},
        r"item 3: label 3 is outside \[0, data\.num_classes=3\)",
    ),
    "too few held out": (
        {"target": "my_datasets:Rows", "val_fraction": 0.1, "eval_samples": 4},
        r"data\.eval_samples=4 but data\.val_fraction=0\.1 holds out 1 items",
    ),
}


@pytest.mark.parametrize("case", list(BAD_DATASETS))
def test_a_bad_custom_dataset_is_one_line(case: str) -> None:
    data, pattern = BAD_DATASETS[case]
    one_line_error(classify_job(kind="custom", **data), pattern)


def test_lm_items_of_the_wrong_length_are_one_line() -> None:
    data = {"kind": "custom", "target": "my_datasets:Windows", "args": {"block": 6}}
    raw = {"data": {**data, "eval_samples": 0}, "model": {"block_size": T}}
    one_line_error(
        config_from_dict(raw),
        r"item 0: \(int64 \[6\], int64 \[6\]\); task\.kind=lm needs \(ids, next ids\), both "
        r"integer \[model\.block_size\] = \[4\]",
    )
