"""`data.kind: text`: `trainstack prepare` (bytes and a BPE trained here), the corpus the
workers read, and held-out bits per byte against gzip -9 and xz -9 on the same bytes."""

from __future__ import annotations

import gzip
import json
import lzma
import math
import os
import shutil
import subprocess
import sysconfig
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from trainstack.cli import main
from trainstack.config import ConfigError, JobConfig, config_from_dict
from trainstack.data import prepare as prepare_module
from trainstack.data.bits_per_byte import (
    bits_per_byte,
    compressed_bits_per_byte,
    held_out_eval_bytes,
    reference_bits_per_byte,
    summary_bits_per_byte,
)
from trainstack.data.paths import resolve_data
from trainstack.data.prepare import ensure_prepared, prepare
from trainstack.data.text import (
    TextCorpus,
    prepared_path,
    split_files,
    stdlib_pattern,
    text_corpus,
)
from trainstack.data.tokens import TokenFile
from trainstack.runtime.progress import format_summary

SEQ_LEN = 16
TEXTS = {
    "a.py": "def add(x, y):\n    return x + y\n" * 40,
    "b.txt": "Grüße aus Köln — naïve café, 東京 and ascii.\n" * 30,
    "c.py": "class Point:\n    def __init__(self, x):\n        self.x = x\n" * 30,
    "d.md": "# Notes\n\nSome prose about tokenizers and bytes.\n" * 30,
}


@pytest.fixture
def corpus_dir(tmp_path: Path) -> Path:
    data = tmp_path / "data"
    data.mkdir()
    for name, text in TEXTS.items():
        (data / name).write_text(text, encoding="utf-8")
    return data


@pytest.fixture(scope="module")
def bpe_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE tokenizer trained here on a few KB of the test texts."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(list(TEXTS.values()), trainer=trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def job(data_dir: Path, tmp: Path, **data: Any) -> JobConfig:
    """A resolved `text` job over data_dir, prepared under tmp/runs/prepared."""
    section = {
        "kind": "text",
        "train": [str(data_dir / "*")],
        "val_fraction": 0.25,
        "vocab_size": 256,
        "eval_samples": 8,
        **data,
    }
    cfg = config_from_dict(
        {
            "model": {"block_size": SEQ_LEN},
            "data": section,
            "checkpoint": {"storage_path": str(tmp / "runs")},
            "log": {"progress": "quiet"},
        }
    )
    return resolve_data(cfg)


def tokens_of(path: Path) -> np.ndarray:
    return np.asarray(TokenFile.open(str(path)).tokens)


def snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in directory.rglob("*")}


def test_bytes_prepare_holds_every_byte_of_each_split_in_file_order(
    corpus_dir: Path, tmp_path: Path
) -> None:
    cfg = job(corpus_dir, tmp_path)
    files = split_files(cfg.data)
    assert [Path(f).name for f in files.held_out] == ["d.md"]  # last quarter by sorted path
    out = prepare(cfg.data)
    train = b"".join(Path(f).read_bytes() for f in files.train)
    assert (
        tokens_of(out.path / "train.bin").tobytes()
        == np.frombuffer(train, np.uint8).astype(np.uint16).tobytes()
    )
    assert (
        bytes(tokens_of(out.path / "val.bin").astype(np.uint8))
        == (corpus_dir / "d.md").read_bytes()
    )
    assert out.meta["splits"]["train"] == {"files": 3, "bytes": len(train), "tokens": len(train)}
    assert out.meta["tokenizer"] == {"name": "bytes", "sha256": None, "vocab_size": 256}
    assert out.path.parent == tmp_path / "runs" / "prepared"
    assert out.path.name == out.meta["fingerprint"][:16]


def test_prepare_is_deterministic_byte_for_byte(corpus_dir: Path, tmp_path: Path) -> None:
    first = prepare(job(corpus_dir, tmp_path / "one").data)
    second = prepare(job(corpus_dir, tmp_path / "two").data)
    assert first.meta["fingerprint"] == second.meta["fingerprint"]
    for name in ("train.bin", "val.bin", "meta.json"):
        assert (first.path / name).read_bytes() == (second.path / name).read_bytes()


def test_second_prepare_reuses_the_complete_directory(corpus_dir: Path, tmp_path: Path) -> None:
    cfg = job(corpus_dir, tmp_path)
    first = prepare(cfg.data)
    before = snapshot(first.path)
    again = prepare(cfg.data)
    assert not first.reused and again.reused and again.path == first.path
    assert snapshot(again.path) == before
    assert again.describe().startswith("reusing prepared data")


def test_changed_input_gets_a_new_directory_and_workers_see_the_change(
    corpus_dir: Path, tmp_path: Path
) -> None:
    cfg = job(corpus_dir, tmp_path)
    first = prepare(cfg.data)
    assert prepared_path(cfg.data) == first.path
    (corpus_dir / "a.py").write_text(TEXTS["a.py"] + "# one more line\n")
    with pytest.raises(ConfigError, match="not prepared"):
        prepared_path(cfg.data)
    second = prepare(cfg.data)
    assert second.path != first.path and prepared_path(cfg.data) == second.path


def test_interrupted_prepare_resumes_where_it_stopped(
    corpus_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = job(corpus_dir, tmp_path)
    root = Path(cfg.data.prepared_dir)
    real = prepare_module._read_input
    tokenized: list[str] = []

    def dies_on_c(item: Any) -> bytes:
        if item.path.endswith("c.py"):
            raise KeyboardInterrupt
        tokenized.append(Path(item.path).name)
        return real(item)

    monkeypatch.setattr(prepare_module, "BATCH_BYTES", 1)  # a batch per file
    monkeypatch.setattr(prepare_module, "_read_input", dies_on_c)
    with pytest.raises(KeyboardInterrupt):
        prepare(cfg.data)
    assert tokenized == ["a.py", "b.txt"]
    assert [p.name.startswith(".partial-") for p in root.iterdir() if p.is_dir()] == [True]
    assert not list(root.glob("*/meta.json"))  # nothing looks complete

    tokenized.clear()
    monkeypatch.setattr(
        prepare_module,
        "_read_input",
        lambda item: tokenized.append(Path(item.path).name) or real(item),
    )
    done = prepare(cfg.data)
    assert tokenized == ["c.py", "d.md"]  # a.py and b.txt were kept from the first run
    assert done.resumed == 2 and "(resumed: 2 files were done)" in done.describe()
    assert not list(root.glob(".partial-*")) and not (done.path / "chunks").exists()
    whole = prepare(job(corpus_dir, tmp_path / "uninterrupted").data)
    for name in ("train.bin", "val.bin", "meta.json"):
        assert (done.path / name).read_bytes() == (whole.path / name).read_bytes()


def test_a_changed_file_is_tokenized_again_on_resume(
    corpus_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = job(corpus_dir, tmp_path)
    real = prepare_module._read_input

    def dies_on_c(item: Any) -> bytes:
        if item.path.endswith("c.py"):
            raise KeyboardInterrupt
        return real(item)

    monkeypatch.setattr(prepare_module, "BATCH_BYTES", 1)
    monkeypatch.setattr(prepare_module, "_read_input", dies_on_c)
    with pytest.raises(KeyboardInterrupt):
        prepare(cfg.data)
    monkeypatch.setattr(prepare_module, "_read_input", real)
    (corpus_dir / "a.py").write_text("x = 1\n" * 50)
    done = prepare(cfg.data)
    assert done.resumed == 0  # a new fingerprint: the old partial work is not used
    train = b"".join(Path(f).read_bytes() for f in split_files(cfg.data).train)
    assert bytes(tokens_of(done.path / "train.bin").astype(np.uint8)) == train


def test_empty_input_file_contributes_no_tokens(corpus_dir: Path, tmp_path: Path) -> None:
    (corpus_dir / "a0_empty.py").write_bytes(b"")
    done = prepare(job(corpus_dir, tmp_path).data)
    splits = done.meta["splits"]
    assert splits["train"]["files"] + splits["val"]["files"] == 5
    assert splits["train"]["tokens"] + splits["val"]["tokens"] == sum(
        len(text.encode()) for text in TEXTS.values()
    )


def test_prepare_never_writes_into_the_input_directory(corpus_dir: Path, tmp_path: Path) -> None:
    before = snapshot(corpus_dir)
    ensure_prepared(job(corpus_dir, tmp_path))
    assert snapshot(corpus_dir) == before
    inside = job(corpus_dir, tmp_path, prepared_dir=str(corpus_dir))
    with pytest.raises(ConfigError, match="holds the input file"):
        prepare(inside.data)
    assert snapshot(corpus_dir) == before


def test_bpe_tokens_match_the_tokenizer_and_batches_change_nothing(
    corpus_dir: Path, tmp_path: Path, bpe_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(bpe_file))
    vocab = tokenizer.get_vocab_size()
    cfg = job(corpus_dir, tmp_path / "serial", tokenizer=str(bpe_file), vocab_size=vocab)
    serial = prepare(cfg.data)  # one batch of every file
    monkeypatch.setattr(prepare_module, "BATCH_BYTES", 1)  # a batch per file
    parallel = prepare(
        job(corpus_dir, tmp_path / "par", tokenizer=str(bpe_file), vocab_size=vocab).data
    )
    files = split_files(cfg.data)
    want = np.concatenate([tokenizer.encode(Path(f).read_text()).ids for f in files.train])
    assert np.array_equal(tokens_of(serial.path / "train.bin"), want)
    assert (serial.path / "train.bin").read_bytes() == (parallel.path / "train.bin").read_bytes()
    assert serial.meta["tokenizer"]["name"] == "tokenizer.json"
    assert serial.meta["splits"]["train"]["tokens"] < serial.meta["splits"]["train"]["bytes"]
    bytes_cfg = job(corpus_dir, tmp_path / "serial")
    assert prepare(bytes_cfg.data).meta["fingerprint"] != serial.meta["fingerprint"]


def test_vocab_mismatch_names_the_tokenizers_size(
    corpus_dir: Path, tmp_path: Path, bpe_file: Path
) -> None:
    cfg = job(corpus_dir, tmp_path, tokenizer=str(bpe_file), vocab_size=300)
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(bpe_file)).get_vocab_size()
    with pytest.raises(ConfigError) as err:
        prepare(cfg.data)
    assert f"set data.vocab_size={vocab}" in str(err.value)
    assert "\n" not in str(err.value)


def test_tokenizer_file_that_does_not_load_is_one_line(corpus_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken.json"
    broken.write_text('{"model": "nope"}')
    cfg = job(corpus_dir, tmp_path, tokenizer=str(broken))
    with pytest.raises(ConfigError, match="not a Hugging Face tokenizers file") as err:
        prepare(cfg.data)
    assert "\n" not in str(err.value)


def test_bad_input_exits_2_with_one_line(
    corpus_dir: Path, tmp_path: Path, bpe_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = tmp_path / "text.yaml"
    spec.write_text(
        f"data:\n  kind: text\n  train: ['{corpus_dir}/*.py', '{corpus_dir}/missing.txt']\n"
        "  val_fraction: 0.25\n  vocab_size: 256\n  eval_samples: 0\n"
        f"checkpoint:\n  storage_path: {tmp_path / 'runs'}\n"
    )
    assert main(["prepare", str(spec)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "missing.txt" in err[0] and "no such file" in err[0]
    (corpus_dir / "latin1.txt").write_bytes("café\n".encode("latin-1"))
    overrides = ["--set", f"data.train=[{corpus_dir}/latin1.txt, {corpus_dir}/a.py]"]
    vocab = json.loads(bpe_file.read_text())["model"]["vocab"]
    bpe = ["--set", f"data.tokenizer={bpe_file}", "--set", f"data.vocab_size={len(vocab)}"]
    assert main(["prepare", str(spec), *overrides, *bpe]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "latin1.txt: not UTF-8 at byte 3" in err[0]
    assert main(["prepare", str(spec), *overrides]) == 0  # bytes: any bytes are tokens
    assert "prepared 2 files" in capsys.readouterr().out


def test_text_corpus_windows_are_the_prepared_tokens(corpus_dir: Path, tmp_path: Path) -> None:
    cfg = job(corpus_dir, tmp_path)
    ensure_prepared(cfg)
    corpus = text_corpus(cfg.data, seq_len=SEQ_LEN)
    val = (corpus_dir / "d.md").read_bytes()
    inputs, targets = corpus.held_out_batch(3, seq_len=SEQ_LEN)
    assert bytes(inputs[1].numpy().astype(np.uint8)) == val[SEQ_LEN : 2 * SEQ_LEN]
    assert bytes(targets[2].numpy().astype(np.uint8)) == val[2 * SEQ_LEN + 1 : 3 * SEQ_LEN + 1]
    assert corpus.fingerprint == TextCorpus.from_config(cfg.data).fingerprint
    assert corpus.fingerprint == prepare(cfg.data).meta["fingerprint"]


def test_bits_per_byte_arithmetic() -> None:
    assert bits_per_byte(math.log(2), tokens=100, num_bytes=100) == pytest.approx(1.0)
    # 1.5 nats per token, 3 bytes per token: 1.5 / ln 2 / 3 bits per byte.
    assert bits_per_byte(1.5, tokens=10, num_bytes=30) == pytest.approx(0.5 / math.log(2))


def test_compressor_references_on_known_bytes() -> None:
    noise = np.random.default_rng(0).integers(0, 256, 50_000, dtype=np.uint8).tobytes()
    refs = compressed_bits_per_byte(noise)
    assert 8.0 < refs["gzip_bits_per_byte"] < 8.1 and 8.0 < refs["xz_bits_per_byte"] < 8.1
    repeated = compressed_bits_per_byte(b"abcd" * 25_000)
    assert repeated["gzip_bits_per_byte"] < 0.1 and repeated["xz_bits_per_byte"] < 0.1
    text = " ".join(TEXTS.values()).encode()
    refs = compressed_bits_per_byte(text)
    assert refs["gzip_bits_per_byte"] == 8 * len(gzip.compress(text, 9)) / len(text)
    assert refs["xz_bits_per_byte"] == 8 * len(lzma.compress(text, preset=9)) / len(text)
    for command, key in (("gzip -9 -n -c", "gzip_bits_per_byte"), ("xz -9 -c", "xz_bits_per_byte")):
        if shutil.which(command.split()[0]):  # the command-line tools agree byte for byte
            out = subprocess.run(command.split(), input=text, capture_output=True, check=True)
            assert 8 * len(out.stdout) / len(text) == refs[key]


def test_eval_bytes_are_the_bytes_the_eval_targets_cover(
    corpus_dir: Path, tmp_path: Path, bpe_file: Path
) -> None:
    cfg = job(corpus_dir, tmp_path)
    ensure_prepared(cfg)
    data, tokens = held_out_eval_bytes(cfg)
    n = cfg.data.eval_samples * SEQ_LEN
    assert tokens == n and data == (corpus_dir / "d.md").read_bytes()[1 : n + 1]

    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(bpe_file)).get_vocab_size()
    bpe = job(corpus_dir, tmp_path, tokenizer=str(bpe_file), vocab_size=vocab)
    ensure_prepared(bpe)
    data, tokens = held_out_eval_bytes(bpe)
    ids = Tokenizer.from_file(str(bpe_file)).encode(TEXTS["d.md"]).ids
    assert tokens == n and data.decode() == Tokenizer.from_file(str(bpe_file)).decode(
        ids[1 : n + 1]
    )
    assert data in (corpus_dir / "d.md").read_bytes() and len(data) > n


def test_summary_reports_bits_per_byte_and_both_compressors(
    corpus_dir: Path, tmp_path: Path
) -> None:
    cfg = job(corpus_dir, tmp_path)
    ensure_prepared(cfg)
    refs = reference_bits_per_byte(cfg)
    assert (prepared_path(cfg.data) / f"reference-b{SEQ_LEN}-n8.json").is_file()
    data, _ = held_out_eval_bytes(cfg)
    assert refs == {
        "eval_bytes": len(data),
        "eval_tokens": len(data),
        **compressed_bits_per_byte(data),
    }
    fields = summary_bits_per_byte(cfg, 1.2)
    assert fields["eval_bits_per_byte"] == pytest.approx(1.2 / math.log(2))
    summary = {
        "strategy": "ddp", "world_size": 2, "device": "cpu", "steps": 10, "final_loss": 1.2,
        "eval_loss": 1.2, "tokens_per_s": 1.0, "samples_per_s": 1.0, "mfu": None,
        "peak_mem_bytes": 2**20, "train_s": 1.0, **fields,
    }  # fmt: skip
    line = next(row for row in format_summary(summary).splitlines() if "bits/byte" in row)
    assert f"{1.2 / math.log(2):.3f} (held-out)" in line
    assert f"gzip -9 {refs['gzip_bits_per_byte']:.3f}" in line and "xz -9" in line
    assert summary_bits_per_byte(job(corpus_dir, tmp_path, eval_samples=0), 1.2) == {}


def test_eval_samples_beyond_the_held_out_windows_is_refused(
    corpus_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match=r"data.eval_samples=500 is more than the \d+"):
        ensure_prepared(job(corpus_dir, tmp_path, eval_samples=500))


def test_stdlib_patterns_name_this_interpreters_standard_library() -> None:
    stdlib = Path(sysconfig.get_path("stdlib"))
    assert stdlib_pattern("stdlib:json/*.py") == str(stdlib / "json" / "*.py")
    assert stdlib_pattern("data/*.txt") == "data/*.txt"
    assert (stdlib / "json" / "__init__.py").is_file() and os.sep in stdlib_pattern("stdlib:x")


def test_report_draws_the_compressors_on_the_loss_plot(tmp_path: Path) -> None:
    from trainstack.report.document import render_report
    from trainstack.report.runs import Series, TrackedRun

    steps = list(range(10, 110, 10))
    loss = Series(
        steps=steps, values=[3 - s / 100 for s in steps], times_s=[1.0 * s for s in steps]
    )
    summary = {
        "eval_loss": 1.6, "final_loss": 1.6, "eval_bits_per_byte": 1.6 / math.log(2),
        "gzip_bits_per_byte": 2.548, "xz_bits_per_byte": 2.461, "eval_bytes": 16384,
        "eval_tokens": 16384, "strategy": "ddp", "device": "cpu", "world_size": 2,
    }  # fmt: skip
    run = TrackedRun(
        run_id="0" * 32, name="stdlib-gpt", status="FINISHED", tracking_uri="sqlite:///x.db",
        tags={}, start_ms=0, end_ms=1000, summary=summary, spec_text=None,
        series={"loss": loss},
    )  # fmt: skip
    report = render_report(run, out_dir=tmp_path).read_text()
    assert "| bits per byte | 2.308 (held-out)  gzip -9 2.548  xz -9 2.461 |" in report
    assert "Dotted: gzip -9 2.548 and xz -9 2.461 bits per byte on the same held-out" in report
    assert (tmp_path / "loss.png").read_bytes().startswith(b"\x89PNG")
