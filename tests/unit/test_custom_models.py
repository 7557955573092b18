"""Your own model: `model.kind: custom` builds, is checked before Ray starts, and every
mistake is one ConfigError line; tasks, FLOP counting, activation checkpointing and
checkpoint compatibility work for any module."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from trainstack import checkpoint as ckpt
from trainstack.config import ConfigError, config_from_dict
from trainstack.models import build_model, checkpoint_blocks, num_params
from trainstack.models.flops import count_training_flops, flops_per_token
from trainstack.runtime.preflight import preflight
from trainstack.tasks import EvalSums, TaskOutputError, build_task, evaluate

USER_MODULE = """
import torch
from torch import nn


class Classifier(nn.Module):
    def __init__(self, width=16, n_classes=10):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, width), nn.ReLU())
        self.head = nn.Linear(width, n_classes)

    def forward(self, x):
        return self.head(self.body(x))


def build(width=16, n_classes=10):
    return Classifier(width, n_classes)


def broken(**kwargs):
    raise ValueError("width must be even")


def not_a_module():
    return 42


def no_params():
    return nn.ReLU()


def wrong_width():
    return Classifier(16, n_classes=7)


class TinyLM(nn.Module):
    def __init__(self, vocab=32, width=16, depth=3):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.out = nn.Linear(width, vocab)

    def pipeline_layers(self):
        return [self.emb, *self.blocks, self.out]

    def forward(self, idx):
        x = idx
        for layer in self.pipeline_layers():
            x = layer(x)
        return x


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


def scalar_loss(outputs, batch):
    _, targets = batch
    return nn.functional.cross_entropy(outputs.flatten(0, -2), targets.flatten())


def vector_loss(outputs, batch):
    return outputs.sum(dim=-1)
"""


@pytest.fixture
def user_pkg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A user's module `my_models_<id>` on sys.path, as a user's package would be."""
    name = f"my_models_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def classify_spec(target: str, **model: object) -> dict:
    return {
        "model": {"kind": "custom", "target": target, **model},
        "task": {"kind": "classify"},
        "data": {"kind": "clusters", "num_classes": 10, "shape": [1, 8, 8], "eval_samples": 16},
        "train": {"steps": 5, "global_batch_size": 8, "micro_batch_size": 4},
        "optim": {"warmup_steps": 1},
    }


def lm_spec(target: str, *, loss: str = "", **model: object) -> dict:
    return {
        "model": {"kind": "custom", "target": target, "block_size": 8, **model},
        "task": {"loss": loss},
        "data": {"vocab_size": 32, "eval_samples": 8},
        "train": {"steps": 5, "global_batch_size": 8, "micro_batch_size": 4},
        "optim": {"warmup_steps": 1},
    }


def test_custom_model_builds_seeded_identically(user_pkg: str) -> None:
    cfg = config_from_dict(classify_spec(f"{user_pkg}:build", args={"width": 8}))
    a = build_model(cfg.model, vocab_size=cfg.data.vocab_size, seed=3)
    b = build_model(cfg.model, vocab_size=cfg.data.vocab_size, seed=3)
    c = build_model(cfg.model, vocab_size=cfg.data.vocab_size, seed=4)
    assert a.body[1].weight.shape == (8, 64)
    for name, value in a.state_dict().items():
        assert torch.equal(value, b.state_dict()[name]), name
    assert not torch.equal(a.head.weight, c.head.weight)


def test_preflight_reports_a_working_custom_model(user_pkg: str) -> None:
    report = preflight(config_from_dict(classify_spec(f"{user_pkg}:Classifier")))
    assert report.model_class == "Classifier"
    assert report.params == 64 * 16 + 16 + 16 * 10 + 10
    assert report.shapes["head.weight"] == [10, 16]


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        (
            "no_such_pkg_xyz.models:build",
            "no module named 'no_such_pkg_xyz.models' (searched sys.path",
        ),
        ("{pkg}:missing", "has no attribute 'missing'; it has: Block, Classifier, TinyLM"),
        ("{pkg}:broken", "raised ValueError: width must be even"),
        ("{pkg}:not_a_module", "returned a int; allowed: an nn.Module"),
        ("{pkg}:no_params", "with no trainable parameters"),
        ("{pkg}:wrong_width", "output has shape [1, 7]; task.kind=classify needs [B, C] = [1, 10]"),
    ],
)
def test_every_bad_target_is_one_config_error_line(
    user_pkg: str, target: str, expected: str
) -> None:
    cfg = config_from_dict(classify_spec(target.format(pkg=user_pkg)))
    with pytest.raises(ConfigError) as err:
        preflight(cfg)
    message = str(err.value)
    assert expected in message
    assert "\n" not in message


def test_target_must_be_an_import_path() -> None:
    with pytest.raises(ConfigError, match=r"is not an import path"):
        config_from_dict(classify_spec("my_models.build"))


def test_lm_output_of_the_wrong_vocabulary_names_both_shapes(user_pkg: str) -> None:
    cfg = config_from_dict(lm_spec(f"{user_pkg}:TinyLM", args={"vocab": 40}))
    with pytest.raises(
        ConfigError, match=r"\[1, 8, 40\]; task.kind=lm needs \[B, T, V\] = \[1, 8, 32\]"
    ):
        preflight(cfg)


def test_user_loss_replaces_cross_entropy_and_must_be_scalar(user_pkg: str) -> None:
    cfg = config_from_dict(lm_spec(f"{user_pkg}:TinyLM", loss=f"{user_pkg}:scalar_loss"))
    preflight(cfg)
    bad = config_from_dict(lm_spec(f"{user_pkg}:TinyLM", loss=f"{user_pkg}:vector_loss"))
    with pytest.raises(ConfigError, match=r"task.loss returned Tensor.*allowed: a scalar tensor"):
        preflight(bad)
    missing = config_from_dict(lm_spec(f"{user_pkg}:TinyLM", loss=f"{user_pkg}:nope"))
    with pytest.raises(ConfigError, match=r"task.loss=.*has no attribute 'nope'"):
        preflight(missing)


def test_classify_needs_a_labelled_source_and_your_own_model() -> None:
    with pytest.raises(ConfigError, match=r"data.kind=markov gives samples for task.kind=lm"):
        config_from_dict(
            {"task": {"kind": "classify"}, "model": {"kind": "custom", "target": "a:b"}}
        )
    with pytest.raises(ConfigError, match=r"task.kind=classify needs your own model"):
        config_from_dict({"task": {"kind": "classify"}, "data": {"kind": "clusters"}})


def test_model_keys_belong_to_their_kind() -> None:
    with pytest.raises(ConfigError, match=r"model.target is set but model.kind=gpt"):
        config_from_dict({"model": {"target": "a:b"}})
    with pytest.raises(ConfigError, match=r"model.hf is set but model.kind=custom"):
        config_from_dict({"model": {"kind": "custom", "target": "a:b", "hf": {"x": 1}}})


def test_classify_task_loss_and_metrics() -> None:
    cfg = config_from_dict(classify_spec("a:b"))
    task = build_task(cfg)
    logits = torch.tensor([[4.0, 0.0] + [0.0] * 8, [0.0, 4.0] + [0.0] * 8])
    labels = torch.tensor([0, 0])
    expected = nn.functional.cross_entropy(logits, labels)
    torch.testing.assert_close(task.loss(logits, labels), expected)
    sums = evaluate(
        task, lambda x: logits, [(torch.zeros(2, 1), labels)], device=torch.device("cpu")
    )
    metrics = EvalSums.of(sums).metrics(task)
    assert metrics["eval_accuracy"] == 0.5
    assert metrics["eval_loss"] == pytest.approx(float(expected))
    with pytest.raises(TaskOutputError, match=r"\[2, 3\].*\[2, 10\]"):
        task.loss(torch.zeros(2, 3), labels)


def test_lm_metrics_are_perplexity_and_bits_per_token() -> None:
    task = build_task(config_from_dict({}))
    metrics = EvalSums(loss_sum=2.0 * 10, count=10, correct=3).metrics(task)
    assert metrics["eval_perplexity"] == pytest.approx(torch.e**2)
    assert metrics["eval_bits_per_token"] == pytest.approx(2.0 / 0.6931471805599453)
    assert metrics["eval_accuracy"] == pytest.approx(0.3)


def test_counted_flops_match_the_gpt_formula_within_5_percent() -> None:
    for model_cfg in (
        {"n_layer": 2, "n_embd": 64, "n_head": 2, "block_size": 64},
        {"n_layer": 4, "n_embd": 128, "n_head": 4, "block_size": 128},
    ):
        cfg = config_from_dict({"model": model_cfg, "data": {"vocab_size": 512}})
        model = build_model(cfg.model, vocab_size=512, seed=0)
        T = cfg.model.block_size
        batch = (torch.randint(0, 512, (2, T)), torch.randint(0, 512, (2, T)))
        counted = count_training_flops(model, batch, task=build_task(cfg)) / (2 * T)
        analytic = model.flops_per_token()
        assert abs(counted / analytic - 1) < 0.05, (counted, analytic)
        assert model.tok_emb.weight.grad is None, "counting must leave no gradients behind"


def test_a_model_without_flops_per_token_is_counted(user_pkg: str) -> None:
    cfg = config_from_dict(classify_spec(f"{user_pkg}:build"))
    model = build_model(cfg.model, vocab_size=cfg.data.vocab_size, seed=0)
    batch = (torch.randn(4, 1, 8, 8), torch.randint(0, 10, (4,)))
    per_sample = flops_per_token(model, batch, task=build_task(cfg))
    # Per sample, a linear layer costs 2·in·out forward and 2·in·out for its weight's
    # gradient; all but the first also pass a gradient to their input (2·in·out more).
    assert per_sample == 4 * 64 * 16 + 6 * 16 * 10


def test_activation_checkpointing_wraps_repeated_layers_and_keeps_gradients(
    user_pkg: str,
) -> None:
    plain_cfg = config_from_dict(lm_spec(f"{user_pkg}:TinyLM"))
    ckpt_cfg = config_from_dict(lm_spec(f"{user_pkg}:TinyLM", activation_checkpointing=True))
    plain = build_model(plain_cfg.model, vocab_size=32, seed=0)
    recomputed = build_model(ckpt_cfg.model, vocab_size=32, seed=0)
    assert all("forward" in vars(block) for block in recomputed.blocks)
    assert "forward" not in vars(recomputed.emb)
    idx = torch.randint(0, 32, (2, 8))
    for model in (plain, recomputed):
        model(idx).square().mean().backward()
    for (name, a), (_, b) in zip(
        plain.named_parameters(), recomputed.named_parameters(), strict=True
    ):
        assert a.grad is not None and b.grad is not None
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-7, msg=name)


def test_checkpoint_modules_must_match_a_class(user_pkg: str) -> None:
    cfg = config_from_dict(
        classify_spec(
            f"{user_pkg}:build", activation_checkpointing=True, checkpoint_modules=["Nope"]
        )
    )
    with pytest.raises(ConfigError, match=r"matches no module of Classifier; .*Linear"):
        build_model(cfg.model, vocab_size=cfg.data.vocab_size, seed=0)
    blocks = checkpoint_blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), class_names=("ReLU",))
    assert [type(b).__name__ for b in blocks] == ["ReLU"]


def test_resume_refuses_a_checkpoint_of_another_shape(tmp_path: Path) -> None:
    manifest = {"model_shapes": {"a.weight": [4, 4], "b.bias": [4]}}
    start = ckpt.Checkpoint(path=tmp_path, manifest=manifest)
    ckpt.check_same_model(start, {"a.weight": [4, 4], "b.bias": [4]})
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.check_same_model(start, {"a.weight": [4, 8], "c.bias": [4]})
    message = str(err.value)
    assert "3 tensors differ" in message
    assert "a.weight [4, 4] in the checkpoint, [4, 8] now" in message
    assert "b.bias [4] in the checkpoint, absent now" in message
    assert "c.bias absent in the checkpoint, [4] now" in message


def test_num_params_counts_a_tied_weight_once() -> None:
    model = build_model(config_from_dict({}).model, vocab_size=64, seed=0)
    unique = {id(p): p.numel() for p in model.parameters()}
    assert num_params(model) == sum(unique.values())
