"""LoRA's parts: the spec's checks (one line each), the adapters peft injects (which
layers, what trains, what the model computes at the start), the planner's memory and
bytes with only the adapters trained, and `trainstack plan` saying so."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from trainstack.cli import main
from trainstack.config import ConfigError, config_from_dict
from trainstack.models import build_model
from trainstack.models.lora import adapter_state, base_state, trainable_parameters
from trainstack.planner.comm import data_parallel_bytes
from trainstack.planner.layouts import Layout
from trainstack.planner.memory import model_state_bytes
from trainstack.planner.workload import trainable_parameter_count

ROOT = Path(__file__).resolve().parents[2]
DEMO = str(ROOT / "jobs/configs/demo.yaml")


def gpt(**lora: Any) -> dict[str, Any]:
    return {
        "model": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16, "lora": lora},
        "data": {"vocab_size": 16},
    }


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (gpt(rank=-1), "model.lora.rank=-1 is out of range; allowed: >= 0 (0: no adapters)"),
        (gpt(rank=4, alpha=0), "model.lora.alpha=0 is out of range; allowed: > 0"),
        (gpt(rank=4, dropout=1.0), "model.lora.dropout=1.0 is out of range; allowed: [0, 1)"),
        (
            {**gpt(rank=4), "strategy": {"kind": "ps"}, "optim": {"grad_clip": 0}},
            "model.lora with strategy.kind=ps: adapters over frozen weights train under "
            "strategy.kind ddp, zero, fsdp, pipeline or auto",
        ),
        (
            {**gpt(rank=4), "strategy": {"kind": "pipeline", "stages": 2, "engine": "deepspeed"}},
            "model.lora with strategy.engine=deepspeed set: adapters do not combine with it yet",
        ),
        (
            {
                **gpt(rank=4),
                "strategy": {"kind": "pipeline", "stages": 2, "tensor_parallel": 2},
                "scaling": {"num_workers": 4},
            },
            "model.lora with strategy.tensor_parallel (under a pipeline) set: adapters do not "
            "combine with it yet",
        ),
        (
            {
                **gpt(rank=3),
                "strategy": {"kind": "fsdp", "tensor_parallel": 2},
                "scaling": {"num_workers": 4},
            },
            "model.lora.rank=3 with strategy.tensor_parallel=2: each rank holds a share",
        ),
        (
            {**gpt(rank=4), "compression": {"kind": "topk"}},
            "model.lora with compression.kind set: adapters do not combine with it yet",
        ),
    ],
)
def test_bad_lora_specs_get_one_line(raw: dict[str, Any], message: str) -> None:
    raw.setdefault("scaling", {"num_workers": 2})
    with pytest.raises(ConfigError) as err:
        config_from_dict(raw)
    assert str(err.value).startswith(message), str(err.value)
    assert "\n" not in str(err.value)


def test_targets_that_match_nothing_are_refused_naming_the_linear_layers() -> None:
    cfg = config_from_dict(gpt(rank=4, target_modules=["q_lin"]))
    with pytest.raises(ConfigError) as err:
        build_model(cfg.model, vocab_size=16, seed=0)
    assert str(err.value).startswith(
        "model.lora.target_modules=['q_lin'] matches no module of GPT; its linear layers: "
    )
    assert "q_proj" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="names LayerNorm modules; allowed: linear layers"):
        build_model(
            config_from_dict(gpt(rank=4, target_modules=["ln_1"])).model, vocab_size=16, seed=0
        )


def test_the_adapters_start_at_the_models_outputs_and_alone_train() -> None:
    plain = build_model(config_from_dict(gpt()).model, vocab_size=16, seed=0)
    cfg = config_from_dict(gpt(rank=4, alpha=8))
    adapted = build_model(cfg.model, vocab_size=16, seed=0)
    tokens = torch.randint(16, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.equal(adapted(tokens), plain(tokens))  # B starts at zero
    # The default targets: each block's query and value projections, rank 4 each.
    trained = {n for n, p in adapted.named_parameters() if p.requires_grad}
    assert trained == {
        f"blocks.{b}.attn.{proj}.lora_{ab}.default.weight"
        for b in (0, 1)
        for proj in ("q_proj", "v_proj")
        for ab in "AB"
    }
    assert trainable_parameters(adapted) == 2 * 2 * 4 * (32 + 32)
    assert base_state(adapted.state_dict()).keys() == plain.state_dict().keys()
    assert all(".default." not in k for k in adapter_state(adapted.state_dict()))
    # The adapters are seeded: every rank draws the same A.
    again = build_model(cfg.model, vocab_size=16, seed=0)
    assert all(
        torch.equal(a, b)
        for a, b in zip(adapted.state_dict().values(), again.state_dict().values(), strict=True)
    )
    assert trainable_parameter_count(cfg) == trainable_parameters(adapted)
    assert trainable_parameter_count(config_from_dict(gpt())) is None


@pytest.mark.parametrize(
    ("layout", "full", "lora"),
    [
        # Ψ = 1000 parameters of which Ψ_t = 10 train; fp32, AdamW (o = 8), 4 ranks.
        (Layout(kind="ddp", devices=4), 16 * 1000, 4 * 1000 + 12 * 10),
        (Layout(kind="zero", devices=4, stage=2), 4000 + 1000 + 3000, 4000 + 10 + 30),
        (Layout(kind="zero", devices=4, stage=3), 1000 + 1000 + 3000, 1000 + 10 + 30),
        (Layout(kind="fsdp", devices=4), 4000, (4000 + 120) // 4),
    ],
)
def test_the_planner_counts_gradients_and_optimizer_state_for_the_adapters_alone(
    layout: Layout, full: int, lora: int
) -> None:
    def state(trainable: int | None) -> int:
        return model_state_bytes(
            layout, params=1000, element_bytes=4, optimizer_bytes=8, trainable=trainable
        ).total

    assert state(None) == full
    assert state(10) == lora
    sent = data_parallel_bytes(layout, params=1000, element_bytes=4, accumulation=1)
    sent_lora = data_parallel_bytes(
        layout, params=1000, element_bytes=4, accumulation=1, trainable=10
    )
    assert sent_lora < sent


def test_plan_shows_the_adapters_saving(capsys: pytest.CaptureFixture[str]) -> None:
    def rows(*sets: str) -> dict[tuple[Any, ...], dict[str, Any]]:
        args = ["plan", DEMO, "--devices", "4", "--json"]
        assert main([*args, *(x for s in sets for x in ("--set", s))]) == 0
        planned = json.loads(capsys.readouterr().out)
        return {(r["layout"], r["micro_batch"], r["recompute"]): r for r in planned}

    full, lora = rows(), rows("model.lora.rank=4")
    assert main(["plan", DEMO, "--devices", "4", "--set", "model.lora.rank=4"]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert "105,856 parameters (2,048 of them train: LoRA)" in header
    layouts = {name for name, _, _ in lora}
    assert {"pp 2 × dp 2", "tp 2 × fsdp 2"} <= layouts
    assert "pp 2 × tp 2" in {name for name, _, _ in full} and "pp 2 × tp 2" not in layouts
    assert lora and lora.keys() <= full.keys()
    for key, row in lora.items():
        assert row["comm_bytes_per_step"] < full[key]["comm_bytes_per_step"], key
        held = row["state_bytes"] + row["host_bytes"]
        assert held < full[key]["state_bytes"] + full[key]["host_bytes"], key
