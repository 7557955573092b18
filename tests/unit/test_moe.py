"""The MoE layer on its own: grouped experts compute what a per-token loop computes,
capacity drops the later assignments, the balance loss is Switch's formula and moves a
collapsed router toward even loads, the routing bias does too, and `model.moe` /
`strategy.expert_parallel` refuse what cannot run in one line."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from trainstack.config import ConfigError, config_from_dict
from trainstack.models import build_model
from trainstack.models.gpt import GPT
from trainstack.models.moe import MoE, load_metrics, take_load, update_balance_bias


def layer(**kwargs: Any) -> MoE:
    torch.manual_seed(0)
    return MoE(8, experts=4, hidden=12, **kwargs).double()


def per_token(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Each token through its top-k experts one at a time, weighted by the router."""
    probs = moe.router(x).softmax(-1)
    gates, chosen = probs.topk(moe.top_k, dim=-1)
    gates = gates / gates.sum(-1, keepdim=True) if moe.top_k > 1 else gates
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for gate, e in zip(gates[t], chosen[t], strict=True):
            out[t] += gate * (F.gelu(x[t] @ moe.w_in[e]) @ moe.w_out[e])
    return out


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_grouped_experts_compute_what_a_loop_over_tokens_computes(top_k: int) -> None:
    moe = layer(top_k=top_k)
    x = torch.randn(2, 15, 8, dtype=torch.float64)
    got = moe(x)
    expected = per_token(moe, x.reshape(-1, 8)).reshape(x.shape)
    assert (got - expected).abs().max() < 1e-12
    load = take_load(moe)
    assert load is not None and load[0, :-1].sum() == 30 * top_k and load[0, -1] == 0


def test_full_experts_drop_later_assignments_and_count_them() -> None:
    moe = layer(top_k=2, capacity_factor=1.0)
    with torch.no_grad():  # every token's first choice is expert 0, its second expert 1
        moe.router.weight.zero_()
        moe.router.weight[0, 0], moe.router.weight[1, 0] = 20.0, 10.0
    x = torch.randn(10, 8, dtype=torch.float64)
    x[:, 0] = 1.0
    room = 5  # ceil(1.0 × 10 tokens × 2 / 4 experts)
    got = moe(x)
    kept = per_token(moe, x[:room])  # tokens 0-4 found room with both experts
    assert (got[:room] - kept).abs().max() < 1e-12
    assert got[room:].abs().max() == 0  # tokens 5-9: dropped by both
    load = take_load(moe)
    assert load is not None
    assert load[0].tolist() == [10, 10, 0, 0, 10]  # assignments per expert, then dropped
    assert load_metrics(load)["moe_drop_rate"] == 0.5


def test_the_balance_loss_is_switch_formula_and_one_times_its_weight_when_uniform() -> None:
    moe = layer(top_k=2, aux_weight=0.1)
    x = torch.randn(40, 8, dtype=torch.float64)
    moe(x)
    probs = moe.router(x).softmax(-1)
    chosen = probs.topk(2, dim=-1).indices
    share = torch.bincount(chosen.flatten(), minlength=4).double() / chosen.numel()
    assert moe.aux_loss is not None
    assert abs(float(moe.aux_loss) - 0.1 * 4 * float((share * probs.mean(0)).sum())) < 1e-12
    with torch.no_grad():
        moe.router.weight.zero_()  # uniform router: E · Σ f_i / E = 1
    moe(x)
    assert abs(float(moe.aux_loss) - 0.1) < 1e-12


def collapsed(**kwargs: Any) -> tuple[MoE, torch.Tensor]:
    """A top-1 layer whose router gives expert 0 a head start of 3 on every token (a
    constant input feature), and 256 otherwise varied tokens: most go to expert 0."""
    moe = layer(top_k=1, **kwargs)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(256, 8, dtype=torch.float64, generator=generator)
    x[:, 0] = 1.0
    with torch.no_grad():
        moe.router.weight.normal_(0, 0.5, generator=generator)
        moe.router.weight[:, 0] = 0.0
        moe.router.weight[0, 0] = 3.0
    return moe, x


def load_cv(moe: MoE, x: torch.Tensor) -> float:
    take_load(moe)
    with torch.no_grad():
        moe(x)
    load = take_load(moe)
    assert load is not None
    return load_metrics(load)["moe_load_cv"]


def test_the_aux_loss_moves_a_collapsed_router_toward_even_loads() -> None:
    moe, x = collapsed(aux_weight=1.0)
    before = load_cv(moe, x)
    optimizer = torch.optim.Adam(moe.router.parameters(), lr=0.05)
    for _ in range(60):
        moe(x)
        assert moe.aux_loss is not None
        optimizer.zero_grad()
        moe.aux_loss.backward()
        optimizer.step()
    after = load_cv(moe, x)
    print(f"load CV {before:.3f} -> {after:.3f}")
    assert before > 1.2  # measured 1.37 (all on one expert: sqrt(3) = 1.73)
    assert after < 0.2  # measured 0.03


def test_the_routing_bias_moves_a_collapsed_router_toward_even_loads() -> None:
    moe, x = collapsed(balance="bias", bias_rate=0.01)
    before = load_cv(moe, x)
    for _ in range(100):
        with torch.no_grad():
            moe.train()(x)
        load = take_load(moe)
        assert load is not None
        update_balance_bias(moe, load)
    after = load_cv(moe, x)
    print(f"load CV {before:.3f} -> {after:.3f}")
    assert before > 1.2 and after < 0.3  # measured: 1.37, then 0.05 and 0.22 in turn


def spec(**moe: Any) -> dict[str, Any]:
    return {
        "model": {"n_layer": 4, "n_embd": 16, "n_head": 2, "block_size": 8, "moe": moe},
        "data": {"vocab_size": 16},
    }


@pytest.mark.parametrize("every", [1, 2, 4])
def test_the_moe_gpt_counts_its_parameters_and_returns_its_aux_loss(every: int) -> None:
    cfg = config_from_dict(spec(experts=4, top_k=2, every=every, expert_hidden=24))
    model = build_model(cfg.model, vocab_size=16, seed=0)
    numel, tensors = GPT.count_parameters(cfg.model, vocab_size=16)
    assert numel == sum(p.numel() for p in model.parameters())
    assert tensors == len(list(model.parameters()))
    out = model(torch.randint(0, 16, (2, 8)))
    assert out.logits.shape == (2, 8, 16) and out.aux_loss.requires_grad
    moe_blocks = [b for b in model.blocks if isinstance(b.mlp, MoE)]
    assert len(moe_blocks) == 4 // every


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"model.moe.experts": 1}, "model.moe.experts=1 is out of range"),
        ({"model.moe.top_k": 5}, "model.moe.top_k=5 is out of range; allowed: 1 to 4"),
        ({"model.moe.balance": "loss"}, "model.moe.balance='loss' is not one of"),
        ({"strategy.kind": "pipeline"}, "do not cross pipeline stages"),
        ({"strategy.kind": "fsdp", "strategy.tensor_parallel": 2}, "no tensor-parallel plan"),
        (
            {"strategy.kind": "ps", "model.moe.balance": "bias", "optim.grad_clip": 0},
            "allowed here: aux_loss or none",
        ),
        ({"model.activation_checkpointing": True}, "route its tokens twice"),
        ({"strategy.expert_parallel": 2, "strategy.kind": "fsdp"}, "only under strategy.kind ddp"),
        ({"strategy.expert_parallel": 3, "scaling.num_workers": 4}, "must divide scaling.num"),
        ({"strategy.expert_parallel": 8, "scaling.num_workers": 8}, "must divide model.moe.exp"),
        ({"model.moe.experts": 0, "strategy.expert_parallel": 2}, "needs MoE layers to split"),
    ],
)
def test_moe_specs_that_cannot_run_are_refused_in_one_line(
    changes: dict[str, Any], words: str
) -> None:
    raw: dict[str, Any] = spec(experts=4)
    raw["scaling"] = {"num_workers": 2}
    for key, value in changes.items():
        section, _, rest = key.partition(".")
        node = raw.setdefault(section, {})
        *path, last = rest.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    with pytest.raises(ConfigError) as refused:
        config_from_dict(raw)
    message = str(refused.value)
    assert words in message and "\n" not in message, message


def test_a_custom_model_is_told_to_build_the_layer_itself() -> None:
    raw = spec(experts=4)
    raw["model"].update(kind="custom", target="user_models.tiny:Tiny")
    with pytest.raises(ConfigError, match=r"trainstack\.models\.moe\.MoE in its own module"):
        config_from_dict(raw)


def test_pre_flight_refuses_an_expert_split_the_model_cannot_take(tmp_path: Any) -> None:
    """A Hugging Face MoE family's experts are counted on the built model: 4 experts do
    not split 8 ways, and a dense family has none to split."""
    from trainstack.runtime.preflight import preflight

    def hf(family: dict[str, Any]) -> dict[str, Any]:
        widths = {
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
        }
        return {
            "model": {"kind": "hf", "hf": {**widths, **family}, "block_size": 8},
            "data": {"vocab_size": 16},
            "strategy": {
                "kind": "ddp",
                "expert_parallel": 8 if "num_local_experts" in family else 2,
            },
            "scaling": {"num_workers": 8 if "num_local_experts" in family else 2},
            "train": {"global_batch_size": 8, "micro_batch_size": 1},
            "checkpoint": {"storage_path": str(tmp_path)},
        }

    mixtral = {"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}
    with pytest.raises(ConfigError, match=r"must divide every MoE layer's experts; .* of 4"):
        preflight(config_from_dict(hf(mixtral)))
    with pytest.raises(ConfigError, match="has no experts to split"):
        preflight(config_from_dict(hf({"model_type": "qwen2"})))
