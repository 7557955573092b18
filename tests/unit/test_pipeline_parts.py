"""The pieces of the pipeline strategy that need no process group: the stage split,
stage modules, the activation meter, activation checkpointing, and spec validation."""

from typing import Any

import pytest
import torch

from trainstack.config import ConfigError, ModelConfig, config_from_dict
from trainstack.models.gpt import GPT
from trainstack.strategies.base import next_token_loss
from trainstack.strategies.pipeline_probe import (
    SavedActivationMeter,
    simulated_bubble,
    single_stage_orders,
)
from trainstack.strategies.pipeline_split import (
    StageModule,
    split_stages,
    stage_ranks,
    unit_params,
)


def gpt(n_layer: int = 6, vocab_size: int = 64, **kw: Any) -> GPT:
    torch.manual_seed(0)
    cfg = ModelConfig(n_layer=n_layer, n_head=2, n_embd=32, block_size=16, **kw)
    return GPT(cfg, vocab_size=vocab_size)


def test_split_minimises_the_largest_stage_counting_embedding_and_head() -> None:
    model = gpt(n_layer=6, vocab_size=1024)  # embedding and head each ~2.6 blocks
    embed, blocks, head = unit_params(model)
    split = split_stages(model, 3)
    assert [len(r) for r in split.blocks] == [1, 4, 1]  # the ends carry embedding and head
    assert split.params == (embed + blocks[0], sum(blocks[1:5]), blocks[5] + head)
    # No other cut of six blocks into three non-empty stages has a smaller largest stage.
    best = min(
        max(embed + sum(blocks[:i]), sum(blocks[i:j]), sum(blocks[j:]) + head)
        for i in range(1, 5)
        for j in range(i + 1, 6)
    )
    assert max(split.params) == best
    assert "stage 0: embedding + blocks 0-0" in split.describe()


def test_split_allows_uneven_layer_counts_and_one_block_per_stage() -> None:
    split = split_stages(gpt(n_layer=5), 5)
    assert [list(r) for r in split.blocks] == [[0], [1], [2], [3], [4]]


def test_stage_modules_chained_equal_the_model_and_own_its_parameter_names() -> None:
    model = gpt(n_layer=4)
    split = split_stages(model, 4)
    stages = [
        StageModule(model, blocks=r, first=s == 0, last=s == 3) for s, r in enumerate(split.blocks)
    ]
    idx = torch.randint(0, 64, (2, 16))
    x = idx
    for stage in stages:
        x = stage(x)
    torch.testing.assert_close(x, model(idx), rtol=0, atol=0)
    merged: dict[str, torch.Tensor] = {}
    for stage in stages:
        merged.update(stage.state_dict())
    assert merged.keys() == model.state_dict().keys()
    # Stages are copies: training one leaves the model alone.
    assert stages[0].tok_emb.weight.data_ptr() != model.tok_emb.weight.data_ptr()


def test_v_placement_folds_the_chain_back_onto_rank_zero() -> None:
    assert stage_ranks(pp_size=2, num_stages=4, style="loop") == [0, 1, 0, 1]
    assert stage_ranks(pp_size=2, num_stages=4, style="v") == [0, 1, 1, 0]
    assert stage_ranks(pp_size=4, num_stages=8, style="v") == [0, 1, 2, 3, 3, 2, 1, 0]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 4), (4, 16), (8, 3)])
def test_simulated_bubble_of_gpipe_and_1f1b_is_p_minus_1_over_m_plus_p_minus_1(
    schedule: str, p: int, m: int
) -> None:
    orders = single_stage_orders(schedule, pp_size=p, microbatches=m)
    assert simulated_bubble(orders, num_stages=p) == pytest.approx((p - 1) / (m + p - 1))


def test_1f1b_order_keeps_at_most_p_minus_rank_forwards_in_flight() -> None:
    for rank, order in single_stage_orders("1f1b", pp_size=4, microbatches=8).items():
        in_flight = peak = 0
        for kind, _, _ in order:
            in_flight += 1 if kind == "F" else -1
            peak = max(peak, in_flight)
        assert peak == 4 - rank


def saved_bytes(model: GPT, idx: torch.Tensor) -> tuple[int, dict[str, torch.Tensor]]:
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    meter = SavedActivationMeter(exclude=params)
    with meter.recording():
        loss = next_token_loss(model(idx), idx)
    held = meter.live_bytes
    loss.backward()
    assert meter.live_bytes == 0  # every saved tensor released after backward
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return held, grads


def test_activation_checkpointing_same_gradients_less_saved_memory() -> None:
    idx = torch.randint(0, 64, (4, 16))
    plain_bytes, plain = saved_bytes(gpt(n_layer=4), idx)
    ckpt_bytes, ckpt = saved_bytes(gpt(n_layer=4, activation_checkpointing=True), idx)
    for name in plain:
        torch.testing.assert_close(ckpt[name], plain[name], rtol=0, atol=0)
    # A block's input (B×T×C floats) is what checkpointing keeps of each block.
    block_input = 4 * 16 * 32 * 4
    assert ckpt_bytes < plain_bytes / 3
    assert ckpt_bytes >= 4 * block_input


def pipeline_spec(**strategy: Any) -> dict[str, Any]:
    s = {"kind": "pipeline", "stages": 2, "microbatches": 4, **strategy}
    d = s.get("data_parallel", 1)
    return {
        "model": {"kind": "gpt", "n_layer": 4},
        "train": {"global_batch_size": 32, "micro_batch_size": 32 // (d * s["microbatches"])},
        "strategy": s,
        "scaling": {"num_workers": s["stages"] * d},
    }


def error_of(raw: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        config_from_dict(raw)
    return str(info.value)


def test_pipeline_layout_resolves_virtual_stages_and_replicas() -> None:
    cfg = config_from_dict(pipeline_spec(schedule="zbv", data_parallel=2))
    assert cfg.pipeline_virtual_stages == 2
    assert cfg.data_parallel_size == 2
    assert cfg.grad_accum_steps == 4


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            {"stages": 3},
            "scaling.num_workers=2 must equal strategy.stages × strategy.data_parallel = 3 × 1 = 3",
        ),
        ({"stages": 1}, "strategy.stages=1 is out of range; allowed: >= 2 (one stage: use ddp)"),
        ({"schedule": "zb"}, "strategy.schedule='zb' is not one of gpipe, 1f1b"),
        (
            {"schedule": "1f1b", "virtual_stages": 2},
            "strategy.virtual_stages=2 needs an interleaved schedule",
        ),
        (
            {"schedule": "interleaved", "virtual_stages": 3},
            "model.n_layer=4 cannot be split into strategy.stages × virtual_stages = 2 × 3",
        ),
        ({"schedule": "interleaved", "microbatches": 2, "stages": 4}, "scaling.num_workers"),
        ({"schedule": "zbv", "virtual_stages": 1}, "allowed: 0 or 2 (the V shape"),
        (
            {"schedule": "dualpipev", "microbatches": 2},
            "strategy.microbatches=2 is out of range for strategy.schedule=dualpipev; "
            "allowed: >= 2 × strategy.stages = 4",
        ),
        (
            {"engine": "deepspeed", "schedule": "gpipe"},
            "is not what strategy.engine=deepspeed runs",
        ),
        ({"engine": "ds"}, "strategy.engine='ds' is not one of torch, deepspeed"),
    ],
)
def test_invalid_pipeline_layouts_are_refused_with_the_reason(
    change: dict[str, Any], expected: str
) -> None:
    raw = pipeline_spec()
    raw["strategy"].update(change)
    assert expected in error_of(raw)


def test_pipeline_micro_batch_size_must_follow_from_microbatches() -> None:
    raw = pipeline_spec()
    raw["train"]["micro_batch_size"] = 4
    assert error_of(raw) == (
        "train.micro_batch_size=4 must be global_batch_size / (data_parallel × microbatches) "
        "= 32 / (1 × 4) = 8 with strategy.kind=pipeline; set it to 8"
    )


def test_interleaved_needs_microbatches_a_multiple_of_stages() -> None:
    raw = pipeline_spec(schedule="interleaved", microbatches=2, stages=4)
    raw["scaling"]["num_workers"] = 4
    raw["model"]["n_layer"] = 8
    raw["train"]["micro_batch_size"] = 16
    assert "must be a multiple of strategy.stages=4" in error_of(raw)


def test_deepspeed_pipeline_refuses_zero_2_and_3() -> None:
    raw = pipeline_spec(engine="deepspeed")
    raw["deepspeed"] = {"zero_optimization": {"stage": 2}}
    assert "supports ZeRO stage 0 or 1 only" in error_of(raw)


@pytest.mark.parametrize("engine", ["torch", "deepspeed"])
def test_pipeline_refuses_bf16_for_now(engine: str) -> None:
    raw = pipeline_spec(engine=engine)
    raw["train"]["precision"] = "bf16"
    assert error_of(raw).startswith("train.precision=bf16 is not supported with strategy.kind")


def test_pipeline_needs_a_gpt() -> None:
    raw = pipeline_spec()
    raw["model"]["kind"] = "mlp"
    assert error_of(raw) == "strategy.kind=pipeline splits a gpt model; got model.kind=mlp"


def test_shipped_pipeline_job_is_the_demo_on_a_two_stage_pipeline() -> None:
    from pathlib import Path

    from trainstack.config import load_config

    jobs = Path(__file__).resolve().parents[2] / "jobs/configs"
    cfg = load_config(str(jobs / "pipeline.yaml"))
    demo = load_config(str(jobs / "demo.yaml"))
    assert (cfg.strategy.schedule, cfg.scaling.num_workers, cfg.grad_accum_steps) == ("1f1b", 2, 4)
    assert (cfg.model, cfg.data, cfg.train.steps) == (demo.model, demo.data, demo.train.steps)
    zbv = load_config(str(jobs / "pipeline.yaml"), ["model.n_layer=4", "strategy.schedule=zbv"])
    assert zbv.pipeline_virtual_stages == 2
