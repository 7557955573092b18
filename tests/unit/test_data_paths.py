"""The driver turns data.train / data.val globs into absolute file lists the workers read."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainstack.config import ConfigError, config_from_dict
from trainstack.data.paths import resolve_data


def tokens_spec(train: list[str], val: list[str] | None = None, **data: object) -> dict:
    return {
        "data": {"kind": "tokens", "train": train, "val": val or [], "eval_samples": 0, **data},
        "checkpoint": {"storage_path": "runs"},
    }


def test_globs_become_sorted_absolute_files_each_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("b.bin", "a.bin", "sub/c.bin"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / "dir.bin").mkdir()  # a directory matching the glob is not a file
    monkeypatch.chdir(tmp_path)
    cfg = resolve_data(config_from_dict(tokens_spec(["*.bin", "a.bin", "**/c.bin"])))
    assert cfg.data.train == (
        str(tmp_path / "a.bin"),
        str(tmp_path / "b.bin"),
        str(tmp_path / "sub/c.bin"),
    )
    assert cfg.data.prepared_dir == str(tmp_path / "runs" / "prepared")


def test_one_path_or_glob_stands_for_a_one_element_list(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`data.train: corpus.bin` as a user writes it, in YAML and with --set."""
    from trainstack.config import load_config

    for name in ("corpus.bin", "held-1.bin", "held-2.bin"):
        (tmp_path / name).write_bytes(b"x")
    monkeypatch.chdir(tmp_path)
    spec = tmp_path / "job.yaml"
    spec.write_text(
        "data:\n  kind: tokens\n  train: corpus.bin\n  val: held-*.bin\n  eval_samples: 0\n"
        "checkpoint:\n  storage_path: runs\n"
    )
    cfg = load_config(str(spec))
    assert cfg.data.train == ("corpus.bin",) and cfg.data.val == ("held-*.bin",)
    resolved = resolve_data(cfg)
    assert resolved.data.train == (str(tmp_path / "corpus.bin"),)
    assert resolved.data.val == (str(tmp_path / "held-1.bin"), str(tmp_path / "held-2.bin"))
    assert load_config(str(spec), ["data.train=held-1.bin"]).data.train == ("held-1.bin",)
    with pytest.raises(ConfigError, match=r"^data\.train: expected a list, got 3 \(int\)"):
        load_config(str(spec), ["data.train=3"])


def test_a_pattern_that_matches_nothing_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"data\.train\[0\]='\*\.bin': matches no file"):
        resolve_data(config_from_dict(tokens_spec(["*.bin"])))
    with pytest.raises(ConfigError, match=r"data\.val\[0\]='held\.bin': no such file"):
        (tmp_path / "a.bin").write_bytes(b"x")
        resolve_data(config_from_dict(tokens_spec(["a.bin"], ["held.bin"])))


def test_synthetic_sources_are_left_as_they_are() -> None:
    cfg = config_from_dict({})
    assert resolve_data(cfg) is cfg


def test_file_sources_need_files_and_held_out_data() -> None:
    with pytest.raises(ConfigError, match=r"data\.train is empty; data\.kind=tokens"):
        config_from_dict({"data": {"kind": "tokens"}})
    with pytest.raises(ConfigError, match=r"data\.eval_samples=256 needs held-out data"):
        config_from_dict({"data": {"kind": "tokens", "train": ["a.bin"]}})
    with pytest.raises(ConfigError, match=r"data\.vocab_size=64 does not match"):
        config_from_dict({"data": {"kind": "text", "train": ["a.txt"], "eval_samples": 0}})
