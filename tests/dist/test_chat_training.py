"""Chat data trains under DDP as one process does: two gloo ranks, each reading its
conversations of the global batch, float64, within `FP64_BOUND`; the loss and the
held-out figures fall on the assistant's tokens only (padding and prompts are -100).
Packed rows (`data.pack`, a qwen2) train as one process does under DDP, under tensor
parallelism over 2 ranks, whose split attention takes the rows' position ids, and under
a 2-stage pipeline, whose first stage hands the second the rows' position ids beside the
hidden states; so do llama and gpt2, whose forward here is their pipeline layers."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from trainstack.config import config_from_dict
from trainstack.runtime.gloo_processes import run_processes

from bounds import FP64_BOUND, assert_trained, max_difference, one_process
from chat_data import make_tokenizer, sums, write_jsonl
from user_model_specs import HF_WIDTHS


def spec(tmp_path: Path) -> dict[str, Any]:
    tokenizer = make_tokenizer(tmp_path / "tok")
    train = write_jsonl(tmp_path / "train.jsonl", sums(40))
    val = write_jsonl(tmp_path / "val.jsonl", sums(8))
    return {
        "name": "chat",
        "model": {"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 24},
        "data": {
            "kind": "chat",
            "train": [str(train)],
            "val": [str(val)],
            "tokenizer": str(tokenizer),
            "vocab_size": 32,
            "eval_samples": 8,
        },
        "train": {"steps": 12, "global_batch_size": 8, "micro_batch_size": 4, "precision": "fp64"},
        "optim": {"lr": 1e-2, "warmup_steps": 2},
        "scaling": {"num_workers": 2},
        "checkpoint": {"storage_path": str(tmp_path / "runs")},
    }


def test_two_ranks_on_chat_data_train_what_one_process_trains(tmp_path: Path) -> None:
    raw = spec(tmp_path)
    reference = one_process(raw, tmp_path / "ref")
    summary = run_processes(config_from_dict(raw), world_size=2, out_dir=tmp_path / "ddp")
    weights = torch.load(tmp_path / "ddp" / "model.pt", weights_only=True)
    diff = max_difference(weights, reference)
    print(f"chat, ddp 2 vs one process: {diff:.3g}; held-out loss {summary['eval_loss']:.3f}")
    assert diff < FP64_BOUND
    assert_trained(reference, raw)
    # Answers are a few words of 31 tokens: the held-out loss, on them alone, is well
    # below a uniform guess's ln 32 after 12 steps (measured: 2.011; untrained: about 3.5).
    assert summary["eval_loss"] < math.log(32) - 1.0


_PACKED_REFERENCE: dict[str, dict[str, torch.Tensor]] = {}
"""The packed run trained by one process, once (its layout does not change it)."""


PIPELINE = {"kind": "pipeline", "stages": 2, "microbatches": 2}
"""1F1B over 2 ranks, 2 micro-batches of 4: the micro-batches one process accumulates."""
GPT2_WIDTHS = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}


@pytest.mark.parametrize(
    ("family", "strategy"),
    [
        ("qwen2", {"kind": "ddp"}),
        ("qwen2", {"kind": "fsdp", "tensor_parallel": 2}),
        ("qwen2", PIPELINE),
        ("llama", PIPELINE),
        ("gpt2", PIPELINE),
    ],
    ids=["ddp", "tp2", "pp2", "llama-pp2", "gpt2-pp2"],
)
def test_two_ranks_on_packed_chat_rows_train_what_one_process_trains(
    family: str, strategy: dict[str, Any], tmp_path: Path
) -> None:
    raw = spec(tmp_path)
    raw["name"] = "chat-packed"
    widths = GPT2_WIDTHS if family == "gpt2" else HF_WIDTHS
    raw["model"] = {"kind": "hf", "hf": {"model_type": family, **widths}, "block_size": 48}
    raw["data"] |= {"pack": True, "eval_samples": 3}  # 40 conversations in 14 rows, 8 in 3
    raw["strategy"] = strategy
    if family not in _PACKED_REFERENCE:
        _PACKED_REFERENCE[family] = one_process(raw, tmp_path / "ref")
    reference = _PACKED_REFERENCE[family]
    summary = run_processes(config_from_dict(raw), world_size=2, out_dir=tmp_path / "two")
    weights = torch.load(tmp_path / "two" / "model.pt", weights_only=True)
    diff = max_difference(weights, reference)
    name = f"{family} {strategy['kind']}" + (" × tp 2" if "tensor_parallel" in strategy else "")
    print(f"packed chat, {name} vs one process: {diff:.3g}; held-out {summary['eval_loss']:.3f}")
    # measured: ddp 0 (bitwise), held-out loss 1.224 on the answers; tensor parallel
    # 2 (position ids through the split attention, fsdp × tp 2 on 2 ranks) 1.1e-14;
    # pipeline 2: qwen2 3.1e-15, llama 2.2e-16, gpt2 9.9e-14 (a second stage counting
    # positions 0..T-1, so no mask: qwen2 0.097, llama 0.086, gpt2 0.078)
    assert diff < FP64_BOUND
    assert_trained(reference, raw)
    assert summary["eval_loss"] < math.log(32) - 1.0
