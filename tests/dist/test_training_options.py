"""Spec options a user picks, in real runs: SGD, the linear and constant LR schedules,
`lr_scaling`, the MLP model and dropout each do what the spec says, and the SGD, MLP
and dropout runs still learn.

Every run trains on the same order-1 Markov language over 16 tokens: its entropy floor is
1.14 nats per token, uniform guessing ln 16 = 2.77, and the untrained models score 2.72
(GPT) and 2.77 (MLP) on the held-out samples. `LEARNED` above the floor (2.04) is a
bound only training meets; the runs here end 0.26 to 0.6 under it.
"""

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from trainstack import checkpoint as ckpt
from trainstack.config import config_from_dict
from trainstack.data import build_corpus
from trainstack.models import build_model
from trainstack.runtime.gloo_processes import run_processes

from bounds import FP64_BOUND

STEPS = 30
LEARNED = 0.9
"""Nats per token above the entropy floor that a run must end within."""


def spec(storage: Path, **sections: dict[str, Any]) -> dict:
    """A 1-layer GPT on one worker; `sections` update the spec's sections key by key."""
    raw: dict[str, Any] = {
        "name": "options",
        "model": {"kind": "gpt", "n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 16},
        "data": {"vocab_size": 16, "order": 1, "eval_samples": 64},
        "train": {"steps": STEPS, "global_batch_size": 16, "micro_batch_size": 16},
        "optim": {"lr": 1e-2, "warmup_steps": 2},
        "scaling": {"num_workers": 1},
        "checkpoint": {"storage_path": str(storage)},
        "log": {"every_steps": 1},
    }
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    return raw


def train(raw: dict, out: Path) -> dict[str, Any]:
    cfg = config_from_dict(raw)
    return run_processes(cfg, world_size=cfg.scaling.num_workers, out_dir=out)


def logged(out: Path, key: str) -> dict[int, float]:
    records = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in records if "event" not in r}


def weights(out: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = torch.load(out / "model.pt", weights_only=True)
    return state


def held_out_loss(raw: dict, state: dict[str, torch.Tensor], *, train_mode: bool) -> float:
    """Mean next-token cross-entropy of `state` on the run's held-out samples."""
    cfg = config_from_dict(raw)
    model = build_model(cfg.model, vocab_size=cfg.data.vocab_size, seed=cfg.train.seed)
    model.load_state_dict(state)
    model.train(train_mode)
    inputs, targets = build_corpus(cfg.data).held_out_batch(
        cfg.data.eval_samples, seq_len=cfg.model.block_size
    )
    with torch.no_grad():
        return F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).item()


def test_sgd_follows_the_linear_schedule_and_learns(tmp_path: Path) -> None:
    warmup, floor_ratio, lr = 5, 0.1, 0.5
    raw = spec(
        tmp_path,
        optim={
            "kind": "sgd",
            "lr": lr,
            "momentum": 0.9,
            "schedule": "linear",
            "warmup_steps": warmup,
            "min_lr_ratio": floor_ratio,
        },
    )
    summary = train(raw, tmp_path / "out")
    # Step s (1-based) runs at the multiplier of step index s - 1: up the warm-up line,
    # then straight down to floor_ratio at the last step.
    expected = {}
    for s in range(1, STEPS + 1):
        i = s - 1
        if i < warmup:
            expected[s] = lr * (i + 1) / warmup
        else:
            expected[s] = lr * (
                floor_ratio + (1 - floor_ratio) * (1 - (i - warmup) / (STEPS - warmup))
            )
    assert logged(tmp_path / "out", "lr") == pytest.approx(expected, rel=1e-9)
    # SGD's state is a momentum buffer per parameter (AdamW's would be exp_avg, ...).
    final = ckpt.resolve(ckpt.run_dir_for(config_from_dict(raw)))
    state = final.load("optimizer.pt")["state"]
    assert state and all(set(s) == {"momentum_buffer"} for s in state.values())
    assert summary["eval_loss"] < summary["entropy_floor"] + LEARNED  # measured: 1.74


def test_lr_scaling_linear_trains_with_the_scaled_lr_held_constant(tmp_path: Path) -> None:
    """Two workers at lr 5e-3 with `lr_scaling: linear` train what one worker trains at
    1e-2 on the same global batch (float64: within `FP64_BOUND` on any CPU); one worker
    at 5e-3 ends elsewhere."""
    optim = {"lr": 5e-3, "lr_scaling": "linear", "schedule": "constant", "warmup_steps": 2}
    fp64 = {"precision": "fp64"}
    scaled = spec(
        tmp_path / "scaled",
        optim=optim,
        train={"micro_batch_size": 8, **fp64},
        scaling={"num_workers": 2},
    )
    train(scaled, tmp_path / "scaled")
    lrs = logged(tmp_path / "scaled", "lr")
    assert lrs == pytest.approx({1: 5e-3, 2: 1e-2} | {s: 1e-2 for s in range(3, STEPS + 1)})

    train(spec(tmp_path / "peak", optim={**optim, "lr": 1e-2}, train=fp64), tmp_path / "peak")
    train(spec(tmp_path / "base", optim=optim, train=fp64), tmp_path / "base")
    got, at_peak, at_base = (weights(tmp_path / n) for n in ("scaled", "peak", "base"))
    diff = max((got[k] - at_peak[k]).abs().max().item() for k in got)
    apart = max((at_base[k] - at_peak[k]).abs().max().item() for k in got)
    print(f"lr_scaling: |scaled - peak| {diff:.3g}, |base - peak| {apart:.3g}")
    assert diff < FP64_BOUND
    assert apart > 1e-3  # measured: 0.18; an unscaled lr would end there


def test_mlp_model_learns(tmp_path: Path) -> None:
    raw = spec(
        tmp_path,
        model={"kind": "mlp", "n_layer": 2, "n_embd": 32, "context": 2},
        optim={"lr": 3e-2},
    )
    summary = train(raw, tmp_path / "out")
    assert summary["eval_loss"] < summary["entropy_floor"] + LEARNED  # measured: 1.78
    cfg = config_from_dict(raw)
    untrained = build_model(cfg.model, vocab_size=16, seed=cfg.train.seed).state_dict()
    assert held_out_loss(raw, untrained, train_mode=False) > summary["entropy_floor"] + LEARNED


def test_dropout_trains_and_evaluates_deterministically_in_eval_mode(tmp_path: Path) -> None:
    raw = spec(tmp_path, model={"dropout": 0.2})
    summary = train(raw, tmp_path / "out")
    state = weights(tmp_path / "out")
    evaluated = held_out_loss(raw, state, train_mode=False)
    sampled = [held_out_loss(raw, state, train_mode=True) for _ in range(2)]
    # The run evaluated in eval mode: its loss is the deterministic one, which train
    # mode's dropout misses by far more than the tolerance (measured: 1.428 against
    # 1.496 and 1.485), differently each time.
    assert summary["eval_loss"] == pytest.approx(evaluated, abs=1e-5)
    assert held_out_loss(raw, state, train_mode=False) == evaluated
    assert all(abs(s - evaluated) > 1e-3 for s in sampled) and sampled[0] != sampled[1]
    assert summary["eval_loss"] < summary["entropy_floor"] + LEARNED  # measured: 1.43
