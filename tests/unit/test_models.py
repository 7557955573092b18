"""Models: shapes, causality, weight tying, parameter and FLOP counts, seeded builds."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainstack.config import ConfigError, ModelConfig
from trainstack.models import GPT, MODELS, WindowMLP, build_model, pipeline_layers

VOCAB = 37
GPT_CFG = ModelConfig(kind="gpt", n_layer=3, n_head=4, n_embd=32, block_size=16)
MLP_CFG = ModelConfig(kind="mlp", n_layer=3, n_embd=24, block_size=16, context=5)


def _unique_numel(model: nn.Module) -> int:
    unique = {id(p): p.numel() for _, p in model.named_parameters(remove_duplicate=False)}
    return sum(unique.values())


def test_models_dict_names_both_families() -> None:
    assert {"gpt": GPT, "mlp": WindowMLP} == MODELS


@pytest.mark.parametrize("cfg", [GPT_CFG, MLP_CFG], ids=["gpt", "mlp"])
def test_forward_maps_tokens_to_logits_over_vocab(cfg: ModelConfig) -> None:
    model = build_model(cfg, vocab_size=VOCAB, seed=0)
    assert isinstance(model, nn.Module)
    idx = torch.randint(0, VOCAB, (3, cfg.block_size))
    logits = model(idx)
    assert logits.shape == (3, cfg.block_size, VOCAB)
    assert logits.dtype == torch.float32
    assert model(idx[:, :5]).shape == (3, 5, VOCAB)


@pytest.mark.parametrize("cfg", [GPT_CFG, MLP_CFG], ids=["gpt", "mlp"])
def test_changing_a_future_token_leaves_earlier_logits_unchanged(cfg: ModelConfig) -> None:
    model = build_model(cfg, vocab_size=VOCAB, seed=1).eval()
    idx = torch.randint(0, VOCAB, (2, cfg.block_size))
    for t in (0, 3, cfg.block_size - 2):
        changed = idx.clone()
        changed[:, t + 1] = (changed[:, t + 1] + 1) % VOCAB
        before, after = model(idx), model(changed)
        torch.testing.assert_close(before[:, : t + 1], after[:, : t + 1])
        assert not torch.allclose(before[:, t + 1], after[:, t + 1])


def test_mlp_sees_only_its_context_window() -> None:
    model = build_model(MLP_CFG, vocab_size=VOCAB, seed=2).eval()
    idx = torch.randint(0, VOCAB, (2, MLP_CFG.block_size))
    changed = idx.clone()
    changed[:, 0] = (changed[:, 0] + 1) % VOCAB
    before, after = model(idx), model(changed)
    c = MLP_CFG.context
    assert not torch.allclose(before[:, c - 1], after[:, c - 1])
    torch.testing.assert_close(before[:, c:], after[:, c:])


def test_gpt_head_is_tied_to_token_embedding() -> None:
    model = build_model(GPT_CFG, vocab_size=VOCAB, seed=0)
    assert isinstance(model, GPT)
    assert model.lm_head.weight is model.tok_emb.weight


def test_gpt_pipeline_layers_compose_to_forward_and_hold_the_models_modules() -> None:
    model = build_model(GPT_CFG, vocab_size=VOCAB, seed=0).eval()
    layers = pipeline_layers(model)
    assert layers is not None and len(layers) == GPT_CFG.n_layer + 2
    idx = torch.randint(0, VOCAB, (2, GPT_CFG.block_size))
    x = idx
    for layer in layers:
        x = layer(x)
    torch.testing.assert_close(x, model(idx))
    owned = {id(p) for p in model.parameters()}
    assert all(id(p) in owned for layer in layers for p in layer.parameters())
    # The tied weight is one Parameter in the first and the last layer.
    assert layers[0].tok_emb.weight is layers[-1].lm_head.weight


def test_a_sequential_is_its_own_pipeline_layers_and_other_modules_have_none() -> None:
    seq = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    assert pipeline_layers(seq) == list(seq)
    assert pipeline_layers(nn.Linear(2, 2)) is None


@pytest.mark.parametrize("cfg", [GPT_CFG, MLP_CFG], ids=["gpt", "mlp"])
def test_num_params_counts_each_unique_tensor_once(cfg: ModelConfig) -> None:
    model = build_model(cfg, vocab_size=VOCAB, seed=0)
    assert model.num_params() == _unique_numel(model)


def test_gpt_param_count_matches_closed_form() -> None:
    V, d, L, T = VOCAB, GPT_CFG.n_embd, GPT_CFG.n_layer, GPT_CFG.block_size
    # Per block: 2 LayerNorms (4d), qkv (3d^2, no bias), attn proj (d^2 + d),
    # fc (4d^2 + 4d), mlp proj (4d^2 + d) = 12d^2 + 10d. Plus tied embedding and ln_f.
    n_nonpos = V * d + L * (12 * d * d + 10 * d) + 2 * d
    model = build_model(GPT_CFG, vocab_size=V, seed=0)
    assert model.num_params() == n_nonpos + T * d


def test_gpt_flops_per_token_is_6n_plus_attention() -> None:
    V, d, L, T = VOCAB, GPT_CFG.n_embd, GPT_CFG.n_layer, GPT_CFG.block_size
    n_nonpos = V * d + L * (12 * d * d + 10 * d) + 2 * d
    model = build_model(GPT_CFG, vocab_size=V, seed=0)
    assert model.flops_per_token() == 6 * n_nonpos + 12 * L * d * T


def test_mlp_flops_per_token_is_6_times_matmul_weights() -> None:
    V, d, L, c = VOCAB, MLP_CFG.n_embd, MLP_CFG.n_layer, MLP_CFG.context
    n_matmul = c * d * d + (L - 1) * d * d + d * V
    model = build_model(MLP_CFG, vocab_size=V, seed=0)
    assert model.flops_per_token() == 6 * n_matmul
    # Everything else is embeddings (V + 1 rows with the pad token) and biases.
    assert model.num_params() == n_matmul + (V + 1) * d + L * d + V


@pytest.mark.parametrize("cfg", [GPT_CFG, MLP_CFG], ids=["gpt", "mlp"])
def test_same_seed_builds_identical_weights_and_other_seed_differs(cfg: ModelConfig) -> None:
    a = build_model(cfg, vocab_size=VOCAB, seed=7).state_dict()
    b = build_model(cfg, vocab_size=VOCAB, seed=7).state_dict()
    c = build_model(cfg, vocab_size=VOCAB, seed=8).state_dict()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert any(not torch.equal(a[n], c[n]) for n in a if a[n].std() > 0)


def test_gpt_init_scales_residual_projections() -> None:
    cfg = ModelConfig(kind="gpt", n_layer=8, n_head=4, n_embd=128, block_size=16)
    params = dict(build_model(cfg, vocab_size=VOCAB, seed=0).named_parameters())
    residual = params["blocks.0.attn.c_proj.weight"].std().item()
    other = params["blocks.0.attn.q_proj.weight"].std().item()
    assert other == pytest.approx(0.02, rel=0.05)
    assert residual == pytest.approx(0.02 / (2 * 8) ** 0.5, rel=0.05)
    assert params["blocks.0.mlp.c_proj.weight"].std().item() == pytest.approx(residual, rel=0.05)


def test_build_model_leaves_global_rng_untouched() -> None:
    torch.manual_seed(123)
    expected = torch.rand(5)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    build_model(GPT_CFG, vocab_size=VOCAB, seed=99)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(torch.rand(5), expected)


def test_unknown_model_kind_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"model\.kind"):
        build_model(ModelConfig(kind="rnn"), vocab_size=VOCAB, seed=0)
