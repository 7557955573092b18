"""Packed chat rows (`data.pack`) through a Hugging Face model: each conversation of a
row is computed exactly as alone (its own positions, attending only to itself)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from trainstack.config import ConfigError, config_from_dict
from trainstack.data import build_corpus
from trainstack.data.paths import resolve_data
from trainstack.models import build_model

from chat_data import make_tokenizer, sums, write_jsonl
from user_model_specs import HF_WIDTHS

BLOCK = 32


def packed_job(tmp_path: Path, family: str) -> Any:
    train = write_jsonl(tmp_path / "chat.jsonl", sums(7))
    raw = {
        "model": {"kind": "hf", "hf": {"model_type": family, **HF_WIDTHS}, "block_size": BLOCK},
        "data": {
            "kind": "chat",
            "train": [str(train)],
            "tokenizer": str(make_tokenizer(tmp_path / "tok")),
            "vocab_size": 32,
            "eval_samples": 0,
            "shuffle": False,
            "pack": True,
        },
    }
    return resolve_data(config_from_dict(raw))


def test_each_packed_conversation_has_the_logits_it_has_alone(tmp_path: Path) -> None:
    cfg = packed_job(tmp_path, "qwen2")
    corpus = build_corpus(cfg.data).at(BLOCK)
    model = build_model(cfg.model, vocab_size=32, seed=0).double().eval()
    assert model.config._attn_implementation == "sdpa"  # what trainstack trains with
    rows = corpus.train.rows
    x, _ = corpus.train_batch(0, len(rows), seq_len=BLOCK)
    worst, conversations = 0.0, 0
    with torch.no_grad():
        packed = model(x)  # [rows, BLOCK, V]
        for r, row in enumerate(rows):
            at = 0
            for i in row:
                alone = torch.tensor([corpus.train.chats[i].ids[:-1]])
                logits = model(alone)[0]
                part = packed[r, at : at + len(logits)]
                worst = max(worst, float((part - logits).abs().max()))
                at += len(logits)
                conversations += 1
    assert conversations == 7 and len(rows) < conversations
    # float64 noise (6e-17 here); a model not given the position ids: 0.25
    assert worst < 1e-12, worst


def test_a_family_whose_forward_is_the_pipeline_layers_refuses_packed_rows(
    tmp_path: Path,
) -> None:
    cfg = packed_job(tmp_path, "llama")
    x, _ = build_corpus(cfg.data).train_batch(0, 1, seq_len=BLOCK)
    model = build_model(cfg.model, vocab_size=32, seed=0)
    with pytest.raises(ConfigError, match=r"model_type=llama runs trainstack's pipeline layers"):
        model(x)
