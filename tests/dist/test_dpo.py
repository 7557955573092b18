"""DPO (`task.kind: dpo` on `data.kind: preference`, the reference the same model with
its LoRA adapters off) trains under DDP and FSDP over two gloo ranks what one process
trains, in float64, and under ZeRO-2 within the float32 reference's own sensitivity;
the held-out pairs' accuracy, rewards and margin reach the summary. Without LoRA (every
weight trains, the reference a frozen copy placed as the policy is) DDP and FSDP train
what one process trains, and hold the memory the planner counts for the copy."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from trainstack.config import config_from_dict
from trainstack.runtime.capacity import model_state
from trainstack.runtime.gloo_processes import run_processes

from bounds import (
    FP64_BOUND,
    assert_trained,
    float32_sensitivity,
    initial_weights,
    max_difference,
    one_process,
    sensitivity_bound,
)
from chat_data import make_tokenizer, write_jsonl

NAMES = ["one", "two", "three", "four", "five"]


def pairs(count: int) -> list[dict[str, Any]]:
    """Sums whose chosen answer is right and whose rejected answer is off by one."""
    out = []
    for i in range(count):
        a, b = i % 3, (i // 3) % 2
        right = a + b + 1  # names are 1-based: "one" is NAMES[0]
        wrong = right - 1 if i % 2 else right + 1
        out.append(
            {
                "prompt": f"what is {NAMES[a]} plus {NAMES[b]}",
                "chosen": f"it equals {NAMES[right]}",
                "rejected": f"it equals {NAMES[wrong]}",
            }
        )
    return out


def spec(tmp_path: Path, *, precision: str = "fp64") -> dict[str, Any]:
    tokenizer = make_tokenizer(tmp_path / "tok")
    return {
        "name": "dpo",
        "model": {
            "n_layer": 1,
            "n_head": 2,
            "n_embd": 16,
            "block_size": 24,
            "lora": {"rank": 4, "alpha": 8},
        },
        "task": {"kind": "dpo"},
        "dpo": {"beta": 0.5},
        "data": {
            "kind": "preference",
            "train": [str(write_jsonl(tmp_path / "train.jsonl", pairs(24)))],
            "val": [str(write_jsonl(tmp_path / "val.jsonl", pairs(6)))],
            "tokenizer": str(tokenizer),
            "vocab_size": 32,
            "eval_samples": 6,
        },
        "train": {
            "steps": 10,
            "global_batch_size": 8,
            "micro_batch_size": 2,
            "precision": precision,
        },
        "optim": {"lr": 5e-2, "warmup_steps": 2},
        "checkpoint": {"storage_path": str(tmp_path / "runs")},
        "log": {"every_steps": 5},
    }


def on_two(
    raw: dict[str, Any], strategy: dict[str, Any], out: Path, *, workers: int = 2
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    spec = {**copy.deepcopy(raw), "strategy": strategy, "scaling": {"num_workers": workers}}
    spec["checkpoint"]["storage_path"] = str(out / "runs")
    summary = run_processes(config_from_dict(spec), world_size=workers, out_dir=out)
    return summary, torch.load(out / "model.pt", weights_only=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    out = tmp_path_factory.mktemp("dpo-reference")
    return one_process(spec(out), out / "one")


@pytest.mark.parametrize("kind", ["ddp", "fsdp", "fsdp-tp2"])
def test_dpo_under_ddp_and_fsdp_trains_what_one_process_trains(
    tmp_path: Path, reference: dict[str, torch.Tensor], kind: str
) -> None:
    """fsdp-tp2: FSDP 2 × tensor parallel 2 (4 ranks), the adapters split as their
    layers are, the logits gathered whole for the answers' log-probabilities."""
    raw = spec(tmp_path)
    if kind == "fsdp-tp2":
        strategy, workers = {"kind": "fsdp", "tensor_parallel": 2}, 4
    else:
        strategy, workers = {"kind": kind}, 2
    summary, weights = on_two(raw, strategy, tmp_path / kind, workers=workers)
    diff = max_difference(weights, reference)
    figures = {k: round(v, 4) for k, v in summary.items() if k.startswith("eval_")}
    print(f"max |dpo {kind} x 2 - one process| = {diff:.3g}; {figures}")
    assert diff < FP64_BOUND
    start = initial_weights(raw)
    moved = max(
        (weights[k] - start[k].double()).abs().max().item() for k in start if ".lora_B." in k
    )
    assert moved > 1e-2  # the adapters trained (B starts at zero)
    for key in (
        "eval_accuracy",
        "eval_reward_chosen",
        "eval_reward_rejected",
        "eval_reward_margin",
    ):
        assert key in summary, key
    margin = summary["eval_reward_chosen"] - summary["eval_reward_rejected"]
    assert summary["eval_reward_margin"] == pytest.approx(margin)


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_dpo_without_lora_trains_every_weight_against_a_frozen_copy_as_one_process_does(
    tmp_path: Path, kind: str
) -> None:
    raw = spec(tmp_path)
    raw["model"].pop("lora")
    raw["train"]["steps"] = 4
    reference = one_process(raw, tmp_path / "one")
    summary, weights = on_two(raw, {"kind": kind}, tmp_path / kind)
    diff = max_difference(weights, reference)
    print(f"max |dpo without lora, {kind} x 2 - one process| = {diff:.3g}")
    assert diff < FP64_BOUND
    assert_trained(weights, raw)

    # Rank 0's model state (its part of the policy, its gradients and AdamW state, and its
    # part of the frozen copy) is what pre-flight and the planner count; the copy is a
    # quarter of it (float64: weights 8, gradients 8, AdamW 16 bytes a parameter), so a
    # meter or a planner that missed it would be 25% off.
    cfg = config_from_dict({**raw, "strategy": {"kind": kind}, "scaling": {"num_workers": 2}})
    measured = sum(summary["model_state_bytes"].values())
    planned = model_state(cfg, summary["params"]).per_worker
    assert abs(measured - planned) <= 0.02 * planned, (measured, planned)
    held = 2 if kind == "fsdp" else 1
    assert planned == 40 * summary["params"] // held  # 32 for the policy, 8 for the copy


def test_dpo_under_zero2_trains_what_one_process_trains(tmp_path: Path) -> None:
    raw = spec(tmp_path, precision="fp32")
    baseline, sensitivity = float32_sensitivity(raw, tmp_path / "float32")
    _, weights = on_two(raw, {"kind": "zero", "stage": 2}, tmp_path / "zero2")
    diff = max_difference(weights, baseline)
    print(f"max |dpo zero-2 x 2 - one process| = {diff:.3g} (sensitivity {sensitivity:.3g})")
    assert diff < sensitivity_bound(sensitivity)
