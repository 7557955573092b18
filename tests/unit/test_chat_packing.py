"""Packed chat rows (`data.pack`) through a Hugging Face model: each conversation of a
row is computed exactly as alone (its own positions, attending only to itself), by a
family's own forward (qwen2) and by the pipeline layers that are llama's and gpt2's
forward here, which also equal the family's own forward on the packed rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from trainstack.config import config_from_dict
from trainstack.data import build_corpus
from trainstack.data.paths import resolve_data
from trainstack.models import build_model

from chat_data import make_tokenizer, sums, write_jsonl
from user_model_specs import HF_WIDTHS

BLOCK = 32
GPT2_WIDTHS = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}
"""gpt2's sizes (it has no intermediate_size or key/value heads of its own)."""


def packed_job(tmp_path: Path, family: str) -> Any:
    train = write_jsonl(tmp_path / "chat.jsonl", sums(7))
    widths = GPT2_WIDTHS if family == "gpt2" else HF_WIDTHS
    raw = {
        "model": {"kind": "hf", "hf": {"model_type": family, **widths}, "block_size": BLOCK},
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


@pytest.mark.parametrize("family", ["qwen2", "llama", "gpt2"])
def test_each_packed_conversation_has_the_logits_it_has_alone(family: str, tmp_path: Path) -> None:
    cfg = packed_job(tmp_path, family)
    corpus = build_corpus(cfg.data).at(BLOCK)
    model = build_model(cfg.model, vocab_size=32, seed=0).double().eval()
    assert model.config._attn_implementation == "sdpa"  # what trainstack trains with
    rows = corpus.train.rows
    x, _ = corpus.train_batch(0, len(rows), seq_len=BLOCK)
    worst, conversations = 0.0, 0
    with torch.no_grad():
        packed = model(x)  # [rows, BLOCK, V]
        own = model.hf(input_ids=x[:, 0], position_ids=x[:, 1], use_cache=False).logits
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
    # float64 noise (qwen2 6e-17, llama 8e-17, gpt2 2e-16); a model not given the
    # position ids: 0.25; decoder layers counting positions 0..T-1 unmasked: llama 0.16,
    # gpt2 0.058; given the positions but no mask: the same; gpt2's embedding at 0..T-1: 0.29
    assert worst < 1e-12, worst
    # llama's and gpt2's pipeline layers compute what transformers' own forward does
    torch.testing.assert_close(packed, own, atol=1e-12, rtol=0)
