"""DPO's parts: the loss on a batch equals a float64 implementation of the formula
written here (the reference computed by a model without adapters, not by switching them
off), for the sigmoid and IPO variants; its held-out sums and figures; preference files
read into interleaved rows with only the answers scored; the spec's checks."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from trainstack.config import ConfigError, config_from_dict
from trainstack.data.preference import PreferenceCorpus
from trainstack.data.sharding import IGNORED_TARGET
from trainstack.models import build_model
from trainstack.models.lora import base_state, is_adapter_key
from trainstack.tasks import (
    EvalSums,
    attach_reference,
    attached_reference,
    build_task,
    evaluate,
    held_parameters,
)

from chat_data import ids, make_tokenizer, write_jsonl
from user_model_specs import HF_WIDTHS

VOCAB, T = 16, 8


def dpo_spec(**dpo: Any) -> dict[str, Any]:
    return {
        "model": {
            "n_layer": 1,
            "n_head": 2,
            "n_embd": 16,
            "block_size": T,
            "lora": {"rank": 2, "alpha": 4},
        },
        "task": {"kind": "dpo"},
        "dpo": dpo,
        "data": {
            "kind": "preference",
            "train": ["unused.jsonl"],
            "vocab_size": VOCAB,
            "eval_samples": 0,
        },
        "train": {"precision": "fp64"},
    }


def trained_model(raw: dict[str, Any]) -> torch.nn.Module:
    """The spec's model in float64 with adapters moved off zero (a policy that differs
    from its reference)."""
    model = build_model(config_from_dict(raw).model, vocab_size=VOCAB, seed=0).double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if is_adapter_key(name):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    return model


def pairs_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """3 pairs (6 rows): a shared prompt, answers of different lengths, padding."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(VOCAB, (6, T), generator=g)
    y = torch.randint(VOCAB, (6, T), generator=g)
    answer_from = [3, 3, 2, 2, 4, 4]
    answer_to = [7, 6, 8, 5, 8, 8]
    for row in range(6):
        y[row, : answer_from[row]] = IGNORED_TARGET
        y[row, answer_to[row] :] = IGNORED_TARGET
    return x, y


def formula(raw: dict[str, Any], *, beta: float, ipo: bool) -> torch.Tensor:
    """DPO's loss by its definition: log π(answer) summed over the answer's tokens (IPO:
    averaged), for the policy (the adapted model) and the reference (the same weights
    without adapters, a model of its own); per pair h = (π_c − ref_c) − (π_r − ref_r);
    the loss −log σ(βh) (IPO: (h − 1/(2β))²), averaged over the pairs."""
    policy = trained_model(raw)
    plain = {"model": {**raw["model"], "lora": {}}, "data": {"vocab_size": VOCAB}}
    reference = build_model(config_from_dict(plain).model, vocab_size=VOCAB, seed=0).double()
    reference.load_state_dict(base_state(policy.state_dict()))
    x, y = pairs_batch()

    def logp(model: torch.nn.Module) -> list[float]:
        out = []
        with torch.no_grad():
            logits = model(x).double()
        for row in range(6):
            total, n = 0.0, 0
            for t in range(T):
                if y[row, t] != IGNORED_TARGET:
                    total += torch.log_softmax(logits[row, t], -1)[y[row, t]].item()
                    n += 1
            out.append(total / n if ipo else total)
        return out

    pi, ref = logp(policy), logp(reference)
    losses = []
    for pair in range(3):
        c, r = 2 * pair, 2 * pair + 1
        h = (pi[c] - ref[c]) - (pi[r] - ref[r])
        if ipo:
            losses.append((h - 1 / (2 * beta)) ** 2)
        else:
            losses.append(-math.log(1 / (1 + math.exp(-beta * h))))
    return torch.tensor(sum(losses) / 3, dtype=torch.float64)


@pytest.mark.parametrize("variant", ["sigmoid", "ipo"])
def test_the_dpo_loss_is_its_formula(variant: str) -> None:
    raw = dpo_spec(beta=0.5, loss=variant)
    task = build_task(config_from_dict(raw))
    model = trained_model(raw)
    x, y = pairs_batch()
    loss = task.loss(task.outputs(model, x, y), y, inputs=x)
    expected = formula(raw, beta=0.5, ipo=variant == "ipo")
    assert torch.allclose(loss, expected, rtol=0, atol=1e-12), (float(loss), float(expected))
    assert loss.requires_grad  # the policy's; the reference carries no gradient
    loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if is_adapter_key(n)]
    assert all(g is not None and g.abs().sum() > 0 for g in grads)
    # The adapters are back on after the reference's forward.
    again = task.loss(task.outputs(model, x, y), y, inputs=x)
    assert torch.equal(again.detach(), loss.detach())


def test_without_lora_the_reference_is_a_frozen_copy_of_the_model_as_it_started() -> None:
    """DPO without adapters: the copy `attach_reference` gives the policy is what the
    reference log-probabilities come from, however far the policy has moved; at the start
    the two are equal, so h = 0 and the sigmoid loss is ln 2 exactly; the copy is no
    parameter or state-dict entry of the policy, and gets no gradient."""
    raw = dpo_spec(beta=0.5)
    raw["model"] = {**raw["model"], "lora": {}}
    cfg = config_from_dict(raw)
    assert cfg.frozen_reference
    task = build_task(cfg)
    policy = build_model(cfg.model, vocab_size=VOCAB, seed=0).double()
    names = list(policy.state_dict())
    attach_reference(policy, copy.deepcopy(policy))
    assert list(policy.state_dict()) == names  # the copy is not saved with the policy
    x, y = pairs_batch()
    start = task.loss(task.outputs(policy, x, y), y, inputs=x)
    assert start.item() == pytest.approx(math.log(2), abs=1e-15)

    reference = attached_reference(policy)
    assert reference is not None and reference is not policy
    with torch.no_grad():
        before = reference(x).clone()
        for p in policy.parameters():  # the policy moves; its reference does not
            p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    outputs = task.outputs(policy, x, y)
    assert torch.equal(outputs.reference, before)
    assert not torch.equal(outputs.logits.detach(), before)
    loss = task.loss(outputs, y, inputs=x)
    assert abs(loss.item() - math.log(2)) > 1e-3
    loss.backward()
    assert all(p.grad is None for p in reference.parameters())
    assert all(p.grad is not None for p in policy.parameters() if p.requires_grad)
    assert len(held_parameters(policy)) == 2 * len(list(policy.parameters()))


def test_packed_pairs_give_each_pair_the_loss_and_rewards_it_has_padded(tmp_path: Path) -> None:
    """`data.pack` with preference pairs (a Hugging Face model, which computes each
    conversation of a packed row as alone): several pairs share a sample, the chosen
    answers on one row and the rejected on the next in the same order, and every pair's
    loss, margin and rewards equal those of the same pair padded to rows of its own."""
    records = [
        {"prompt": f"what is {a} plus {b}", "chosen": f"it is {a + b}", "rejected": f"{a - b}"}
        for a, b in [(1, 2), (3, 4), (2, 2), (5, 1), (4, 3), (1, 1), (2, 5)]
    ]
    raw = {
        "model": {
            "kind": "hf",
            "hf": {"model_type": "qwen2", **HF_WIDTHS},
            "block_size": 64,
            "lora": {"rank": 2, "alpha": 4},
        },
        "task": {"kind": "dpo"},
        "dpo": {"beta": 0.5},
        "data": {
            "kind": "preference",
            "train": [str(write_jsonl(tmp_path / "pairs.jsonl", records))],
            "tokenizer": str(make_tokenizer(tmp_path / "tok")),
            "vocab_size": 32,
            "eval_samples": 0,
            "shuffle": False,
            "pack": True,
        },
        "train": {"precision": "fp64"},
    }
    packed_cfg = config_from_dict(raw)
    padded_cfg = config_from_dict({**raw, "data": {**raw["data"], "pack": False}})
    packed = PreferenceCorpus.from_config(packed_cfg.data).at(64).train
    padded = PreferenceCorpus.from_config(padded_cfg.data).at(64).train
    assert len(padded) == 7 and len(packed) < 7  # several pairs share a sample
    x, y = packed.take(np.arange(len(packed)), seq_len=64)
    assert x.shape == (2 * len(packed), 2, 64) and y.shape == (2 * len(packed), 64)
    px, py = padded.take(np.arange(7), seq_len=64)

    model = build_model(packed_cfg.model, vocab_size=32, seed=0).double()
    with torch.no_grad():  # a policy that differs from its reference
        for name, p in model.named_parameters():
            if is_adapter_key(name):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    task = build_task(packed_cfg)
    together = task.preferences(task.eval_outputs(model, x), y)
    alone = task.preferences(task.eval_outputs(model, px), py)
    assert len(together.losses) == 7  # every pair found again, in file order
    for field in ("losses", "margins", "chosen_rewards", "rejected_rewards"):
        a, b = getattr(together, field), getattr(alone, field)
        assert torch.allclose(a, b, rtol=0, atol=1e-12), (field, a, b)
    assert alone.margins.abs().min() > 1e-3  # the pairs' figures differ from one another


def test_held_out_sums_give_the_accuracy_rewards_and_margin() -> None:
    raw = dpo_spec(beta=0.5)
    task = build_task(config_from_dict(raw))
    model = trained_model(raw).eval()
    x, y = pairs_batch()
    sums = evaluate(
        task, lambda inputs: task.eval_outputs(model, inputs), [(x, y)], device=torch.device("cpu")
    )
    figures = EvalSums.of(sums).metrics(task)
    p = task.preferences(task.eval_outputs(model, x), y)
    assert figures["eval_loss"] == pytest.approx(float(p.losses.mean()), abs=1e-12)
    assert figures["eval_accuracy"] == float((p.margins > 0).double().mean())
    assert figures["eval_reward_chosen"] == pytest.approx(float(p.chosen_rewards.mean()))
    assert figures["eval_reward_rejected"] == pytest.approx(float(p.rejected_rewards.mean()))
    margin = figures["eval_reward_chosen"] - figures["eval_reward_rejected"]
    assert figures["eval_reward_margin"] == pytest.approx(margin)
    # β × the log-ratios: the chosen reward minus the rejected one is β·h per pair.
    assert torch.allclose(p.chosen_rewards - p.rejected_rewards, 0.5 * p.margins)


def test_preference_files_become_interleaved_rows_scoring_the_answers(tmp_path: Path) -> None:
    tokenizer = make_tokenizer(tmp_path / "tok")
    path = write_jsonl(
        tmp_path / "pairs.jsonl",
        [
            {"prompt": "add one and two", "chosen": "three", "rejected": "four"},
            {
                "prompt": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "hello"},
                    {"role": "user", "content": "what is two plus two"},
                ],
                "chosen": "it equals four",
                "rejected": "five",
            },
        ],
    )
    raw = {
        "model": {"block_size": 40, "lora": {"rank": 2}},
        "task": {"kind": "dpo"},
        "data": {
            "kind": "preference",
            "train": [str(path)],
            "tokenizer": str(tokenizer),
            "eval_samples": 0,
        },
    }
    data = config_from_dict(raw).data
    corpus = PreferenceCorpus.from_config(data).at(40)
    x, y = corpus.train.take([0, 1], seq_len=40)
    assert x.shape == y.shape == (4, 40)
    scored = [[int(t) for t in row if t != IGNORED_TARGET] for row in y]
    # Each row scores its answer and the end of the assistant's turn, nothing before.
    end = ids("<|im_end|>")
    assert scored == [
        ids("three") + end,
        ids("four") + end,
        ids("it equals four") + end,
        ids("five") + end,
    ]
    assert torch.equal(x[0, :5], x[1, :5])  # one prompt for both answers

    def refused(record: Any) -> str:
        bad = write_jsonl(tmp_path / "bad.jsonl", [record])
        data = config_from_dict({**raw, "data": {**raw["data"], "train": [str(bad)]}}).data
        with pytest.raises(ConfigError) as err:
            PreferenceCorpus.from_config(data).at(40)
        assert "\n" not in str(err.value)
        return str(err.value)

    assert 'expected {"prompt", "chosen", "rejected"}' in refused({"prompt": "hi"})
    assert "the prompt ends with the assistant" in refused(
        {"prompt": [{"role": "assistant", "content": "hi"}], "chosen": "a", "rejected": "b"}
    )
    assert "rejected must be the assistant's answer, as text" in refused(
        {"prompt": "hi", "chosen": "hello", "rejected": ""}
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"model": {"lora": {}}, "strategy": {"kind": "zero", "stage": 3}},
            "task.kind=dpo without model.lora under strategy.kind=zero: allowed: strategy.kind "
            "ddp or fsdp; or set model.lora (then zero too)",
        ),
        (
            {"model": {"n_layer": 2}, "strategy": {"kind": "pipeline"}},
            "task.kind=dpo under strategy.kind=pipeline: allowed: strategy.kind ddp, fsdp or zero",
        ),
        (
            {"model": {"lora": {}}, "strategy": {"kind": "fsdp", "tensor_parallel": 2}},
            "task.kind=dpo with strategy.tensor_parallel set",
        ),
        ({"dpo": {"beta": 0}}, "dpo.beta=0.0 is out of range; allowed: > 0"),
        ({"dpo": {"loss": "hinge"}}, "dpo.loss='hinge' is not one of sigmoid, ipo"),
        ({"task": {"kind": "lm"}}, "data.kind=preference gives samples for task.kind=dpo"),
        ({"model": {"fused_loss": True}}, "model.fused_loss=true computes the lm task's"),
    ],
)
def test_bad_dpo_specs_get_one_line(change: dict[str, Any], message: str) -> None:
    raw = dpo_spec()
    for section, values in change.items():
        raw[section] = {**raw.get(section, {}), **values}
    with pytest.raises(ConfigError) as err:
        config_from_dict(raw)
    assert str(err.value).startswith(message), str(err.value)
    assert "\n" not in str(err.value)


def test_a_preference_jobs_tokenizer_is_made_absolute_for_the_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trainstack.data.paths import resolve_data

    make_tokenizer(tmp_path / "tok")
    write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "hi", "chosen": "a", "rejected": "b"}])
    monkeypatch.chdir(tmp_path)
    raw = dpo_spec()
    raw["data"] = {**raw["data"], "train": ["pairs.jsonl"], "tokenizer": "tok"}
    data = resolve_data(config_from_dict(raw)).data
    assert data.tokenizer == str(tmp_path / "tok") and data.train == (
        str(tmp_path / "pairs.jsonl"),
    )
