"""The pieces of the pipeline strategy that need no process group: the stage split,
stage modules and their names, ties, the pre-flight check, the activation meter,
activation checkpointing, and spec validation."""

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from trainstack.config import ConfigError, ModelConfig, config_from_dict
from trainstack.models import build_model
from trainstack.strategies.pipeline_probe import (
    BoundaryMeter,
    SavedActivationMeter,
    simulated_bubble,
    single_stage_orders,
)
from trainstack.strategies.pipeline_split import (
    StageModule,
    check_pipeline_model,
    model_layers,
    split_stages,
    stage_ranks,
    tied_parameters,
)


def gpt(n_layer: int = 6, vocab_size: int = 64, **kw: Any) -> nn.Module:
    cfg = ModelConfig(n_layer=n_layer, n_head=2, n_embd=32, block_size=16, **kw)
    return build_model(cfg, vocab_size=vocab_size, seed=0)


def layer_params(model: nn.Module) -> list[int]:
    return [sum(p.numel() for p in layer.parameters()) for layer in model_layers(model)]


def test_split_minimises_the_largest_stage_counting_embedding_and_head() -> None:
    model = gpt(n_layer=6, vocab_size=1024)  # embedding and head each ~2.6 blocks
    embed, *blocks, head = layer_params(model)  # the head's weight is the embedding's
    split = split_stages(model_layers(model), 3)
    assert [len(r) for r in split.layers] == [2, 4, 2]  # the ends carry embedding and head
    assert split.params == (embed + blocks[0], sum(blocks[1:5]), blocks[5] + head)
    # No other cut of the eight layers into three non-empty stages has a smaller largest.
    sizes = [embed, *blocks, head]
    best = min(
        max(sum(sizes[:i]), sum(sizes[i:j]), sum(sizes[j:]))
        for i in range(1, 7)
        for j in range(i + 1, 8)
    )
    assert max(split.params) == best
    assert split.describe().startswith(
        f"stage 0: layers 0-1 = GPTEmbedding + Block ({split.params[0]:,} params); "
        "stage 1: layers 2-5 = 4 × Block"
    )


def test_split_allows_one_layer_per_stage() -> None:
    split = split_stages(model_layers(gpt(n_layer=3)), 5)
    assert [list(r) for r in split.layers] == [[0], [1], [2], [3], [4]]


def test_stage_modules_chained_equal_the_model_and_own_its_parameter_names() -> None:
    model = gpt(n_layer=4)
    layers = model_layers(model)
    split = split_stages(layers, 4)
    stages = [StageModule(model, layers, r) for r in split.layers]
    idx = torch.randint(0, 64, (2, 16))
    x = idx
    for stage in stages:
        x = stage(x)
    torch.testing.assert_close(x, model(idx), rtol=0, atol=0)
    merged: dict[str, torch.Tensor] = {}
    for stage in stages:
        merged.update(stage.state_dict())
    assert merged.keys() == model.state_dict().keys()
    assert "tok_emb.weight" in stages[0].state_dict()
    assert "lm_head.weight" in stages[-1].state_dict()
    assert "blocks.2.attn.q_proj.weight" in stages[2].state_dict()
    # Stages are copies: no tensor shares storage with the model.
    model_storage = {t.untyped_storage().data_ptr() for t in model.state_dict().values()}
    for stage in stages:
        assert not any(
            t.untyped_storage().data_ptr() in model_storage for t in stage.state_dict().values()
        )


def test_stage_modules_load_the_models_names_back() -> None:
    model = gpt(n_layer=2)
    layers = model_layers(model)
    split = split_stages(layers, 2)
    stages = [StageModule(model, layers, r) for r in split.layers]
    other = gpt(n_layer=2, dropout=0.0)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    full = other.state_dict()
    for stage in stages:
        stage.load_state_dict({name: full[name] for name in stage.state_dict()})
        for name, value in stage.state_dict().items():
            assert torch.equal(value, full[name]), name
    # A key of another stage is unexpected, strictly.
    with pytest.raises(RuntimeError, match="Unexpected key"):
        stages[0].load_state_dict(full)


class Embed(nn.Module):
    def __init__(self, embed: nn.Embedding) -> None:
        super().__init__()
        self.embed = embed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embed(x)


class Head(nn.Module):
    """Reads the embedding's weight directly: a tie held as a bare parameter."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class TiedMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.hidden = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.out_weight = self.embed.weight

    def pipeline_layers(self) -> list[nn.Module]:
        return [Embed(self.embed), *self.hidden, Head(self.embed.weight)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.pipeline_layers():
            x = layer(x)
        return x


def test_a_user_models_stages_use_its_names_and_find_its_tie() -> None:
    torch.manual_seed(0)
    model = TiedMLP()
    layers = model_layers(model)
    split = split_stages(layers, 3)
    ties = tied_parameters(model, layers, split)
    assert [(t.name, t.stages, t.uses) for t in ties] == [
        ("out_weight", (0, 2), ((0, "embed.weight"), (4, "weight")))
    ]
    stages = [StageModule(model, layers, r) for r in split.layers]
    # The head holds the tensor itself: it is named by every key the model has for it.
    assert set(stages[-1].state_dict()) >= {"embed.weight", "out_weight"}
    merged: dict[str, torch.Tensor] = {}
    for stage in stages:
        merged.update(stage.state_dict())
    assert merged.keys() == model.state_dict().keys()
    copy = stages[-1].parameter(layer=4, name="weight")
    assert torch.equal(copy, model.embed.weight) and copy is not model.embed.weight


def test_sequential_cnn_is_its_own_layers_and_its_stages_keep_its_names() -> None:
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 8 * 8, 3)
    )
    layers = model_layers(model)
    split = split_stages(layers, 2)
    stages = [StageModule(model, layers, r) for r in split.layers]
    assert [set(s.state_dict()) for s in stages] == [{"0.weight", "0.bias"}, {"3.weight", "3.bias"}]
    meter = BoundaryMeter(stages[0])
    x = torch.randn(2, 1, 8, 8)
    torch.testing.assert_close(stages[1](stages[0](x)), model(x), rtol=0, atol=0)
    assert meter.output_bytes == 2 * 4 * 8 * 8 * 4  # what crosses the cut: [2, 4, 8, 8] floats
    assert meter.input_grad_bytes == 2 * 1 * 8 * 8 * 4


def pipeline_cfg(**strategy: Any) -> Any:
    return config_from_dict(pipeline_spec(**strategy))


def test_check_pipeline_model_refuses_a_model_without_layers() -> None:
    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(2, 2)

    with pytest.raises(ConfigError) as info:
        check_pipeline_model(pipeline_cfg(), Plain())
    assert str(info.value) == (
        "strategy.kind=pipeline: the model (Plain) has neither pipeline_layers() nor is an "
        "nn.Sequential; add a pipeline_layers() method returning its layers in order"
    )


def test_check_pipeline_model_refuses_fewer_layers_than_stages() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2))
    check_pipeline_model(pipeline_cfg(stages=3), model)
    cfg = pipeline_cfg(stages=2, schedule="interleaved", virtual_stages=2)
    with pytest.raises(ConfigError) as info:
        check_pipeline_model(cfg, model)
    assert str(info.value) == (
        "strategy.stages × virtual_stages = 2 × 2 = 4 pipeline stages need a layer each, but "
        "Sequential has 3 pipeline layers; use at most 3 stages or split the model into more "
        "layers"
    )


def test_check_pipeline_model_refuses_layers_that_leave_out_or_add_state() -> None:
    class Partial(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.unused = nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)

        def pipeline_layers(self) -> list[nn.Module]:
            return [self.a, self.b]

    with pytest.raises(ConfigError, match=r"none of its 2 pipeline layers holds \(2 keys: "):
        check_pipeline_model(pipeline_cfg(), Partial())

    class Foreign(Partial):
        def pipeline_layers(self) -> list[nn.Module]:
            return [self.a, self.b, self.unused, nn.Linear(2, 2)]

    with pytest.raises(ConfigError, match=r"pipeline layer 3 \(Linear\) holds 'weight', which"):
        check_pipeline_model(pipeline_cfg(), Foreign())


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


def saved_bytes(model: nn.Module, idx: torch.Tensor) -> tuple[int, dict[str, torch.Tensor]]:
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    meter = SavedActivationMeter(exclude=params)
    with meter.recording():
        loss = F.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
    held = meter.live_bytes
    loss.backward()
    assert meter.live_bytes == 0  # every saved tensor released after backward
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return held, grads


def test_activation_checkpointing_same_gradients_less_saved_memory() -> None:
    """`build_model` checkpoints the blocks, and a stage's deep copy keeps that."""
    idx = torch.randint(0, 64, (4, 16))
    plain_bytes, plain = saved_bytes(gpt(n_layer=4), idx)
    checkpointed = gpt(n_layer=4, activation_checkpointing=True)
    ckpt_bytes, ckpt = saved_bytes(checkpointed, idx)
    for name in plain:
        torch.testing.assert_close(ckpt[name], plain[name], rtol=0, atol=0)
    # A block's input (B×T×C floats) is what checkpointing keeps of each block.
    block_input = 4 * 16 * 32 * 4
    assert ckpt_bytes < plain_bytes / 3
    assert ckpt_bytes >= 4 * block_input
    layers = model_layers(checkpointed)
    stage = StageModule(checkpointed, layers, range(len(layers)))
    assert saved_bytes(stage, idx)[0] == ckpt_bytes


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
            "scaling.num_workers=2 must equal strategy.stages × strategy.data_parallel × "
            "strategy.tensor_parallel = 3 × 1 × 1 = 3",
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


def test_deepspeed_pipelines_refuse_bf16() -> None:
    raw = pipeline_spec(engine="deepspeed")
    raw["train"]["precision"] = "bf16"
    assert error_of(raw).startswith("train.precision=bf16 with strategy.engine=deepspeed")


def test_pipeline_refuses_the_mlp_which_has_no_layers() -> None:
    raw = pipeline_spec()
    raw["model"]["kind"] = "mlp"
    assert error_of(raw).startswith("strategy.kind=pipeline cuts a model into its pipeline layers")


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
