"""The LM head's loss without the logits: the chunked torch version equals the plain
`cross_entropy(hidden @ weight.T, targets)` and its gradients (float32 within 1e-5 on
any CPU, float64 to rounding), chunks that do not divide the tokens and ignored targets
included; the GPT's fused loss equals its plain one; a spec it cannot serve is refused
in one line."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from trainstack.config import ConfigError, config_from_dict
from trainstack.models import build_model
from trainstack.models.linear_ce import linear_cross_entropy
from trainstack.tasks import build_task


def case(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=g, dtype=dtype).requires_grad_()
    weight = (torch.randn(50, 16, generator=g, dtype=dtype) * 0.3).requires_grad_()
    targets = torch.randint(0, 50, (37,), generator=g)
    targets[[3, 20]] = -100  # ignored, as padding would be
    return hidden, weight, targets


@pytest.mark.parametrize(("dtype", "bound"), [(torch.float32, 1e-5), (torch.float64, 1e-12)])
@pytest.mark.parametrize("chunk_rows", [1, 5, 37, 64])
def test_chunked_loss_and_gradients_equal_the_plain_ones(
    dtype: torch.dtype, bound: float, chunk_rows: int
) -> None:
    hidden, weight, targets = case(dtype)
    plain = F.cross_entropy(hidden @ weight.t(), targets)
    plain_grads = torch.autograd.grad(plain * 3.0, (hidden, weight))
    fused = linear_cross_entropy(hidden, weight, targets, chunk_elements=chunk_rows * 50)
    fused_grads = torch.autograd.grad(fused * 3.0, (hidden, weight))
    assert abs(float(fused) - float(plain)) < bound
    for got, want in zip(fused_grads, plain_grads, strict=True):
        assert (got - want).abs().max() < bound


def spec(**model: Any) -> dict[str, Any]:
    return {
        "model": {"n_layer": 2, "n_embd": 16, "n_head": 2, "block_size": 8, **model},
        "data": {"vocab_size": 16},
    }


@pytest.mark.parametrize("moe", [{}, {"experts": 4}], ids=["dense", "moe"])
def test_the_gpt_fused_loss_trains_on_what_its_logits_would(moe: dict[str, Any]) -> None:
    cfg = config_from_dict(spec(fused_loss=True, moe=moe))
    model = build_model(cfg.model, vocab_size=16, seed=0).double()
    task = build_task(cfg)
    x, y = torch.randint(0, 16, (3, 8)), torch.randint(0, 16, (3, 8))
    fused = task.loss(task.outputs(model, x, y), y)
    fused_grads = torch.autograd.grad(fused, list(model.parameters()))
    plain = task.loss(model(x), y)  # no targets: logits, and the plain cross-entropy
    plain_grads = torch.autograd.grad(plain, list(model.parameters()))
    assert abs(float(fused) - float(plain)) < 1e-12
    for got, want in zip(fused_grads, plain_grads, strict=True):
        assert (got - want).abs().max() < 1e-12


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"model": {"kind": "mlp"}}, "is for model.kind gpt; got mlp"),
        ({"task": {"loss": "pkg.mod:fn"}}, "cannot take task.kind classify or dpo, or task.loss"),
        ({"strategy": {"kind": "pipeline"}, "scaling": {"num_workers": 2}}, "last stage"),
        (
            {"strategy": {"kind": "fsdp", "tensor_parallel": 2}, "scaling": {"num_workers": 2}},
            "loss_parallel already does",
        ),
    ],
)
def test_a_fused_loss_it_cannot_serve_is_refused_in_one_line(
    changes: dict[str, Any], words: str
) -> None:
    raw = spec(fused_loss=True)
    for section, values in changes.items():
        raw[section] = {**raw.get(section, {}), **values}
    with pytest.raises(ConfigError) as refused:
        config_from_dict(raw)
    assert words in str(refused.value) and "\n" not in str(refused.value)
