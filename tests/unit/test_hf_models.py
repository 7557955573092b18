"""`model.kind: hf`: llama and gpt2 built from a config compute HF's own logits through
their pipeline layers, keep HF's state-dict keys and ties, build the same for the same
seed, checkpoint activations, export to and start from save_pretrained directories, and
every mistake is one ConfigError line. Tiny configs, CPU, nothing downloaded."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from trainstack.config import ConfigError, ModelConfig, config_from_dict
from trainstack.models import build_model, checkpoint_blocks, repeated_blocks
from trainstack.models.hf import HFCausalLM, build_hf_model, export_pretrained
from trainstack.strategies.pipeline_split import (
    StageModule,
    check_pipeline_model,
    split_stages,
    tied_parameters,
)

transformers = pytest.importorskip("transformers")

VOCAB = 48
T = 12
HF: dict[str, dict[str, Any]] = {
    "llama": {
        "model_type": "llama",
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 64,
    },
    "gpt2": {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4},
}
FAMILIES = sorted(HF)


def model_cfg(family: str, **hf: Any) -> ModelConfig:
    return ModelConfig(kind="hf", hf={**HF[family], **hf}, block_size=T)


def build(family: str, *, seed: int = 0, **hf: Any) -> HFCausalLM:
    model = build_model(model_cfg(family, **hf), vocab_size=VOCAB, seed=seed)
    assert isinstance(model, HFCausalLM)
    return model


def tokens(batch: int = 3) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, T), generator=torch.Generator().manual_seed(7))


def hf_twin(model: HFCausalLM) -> nn.Module:
    """HF's own model with `model`'s weights."""
    twin = transformers.AutoModelForCausalLM.from_config(model.config).eval()
    twin.load_state_dict(model.state_dict())
    return twin


def perturbed(model: HFCausalLM) -> HFCausalLM:
    """Move every weight off its initial value (norm weights start at exactly 1)."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_hf_own_forward_and_state_dict_keys_are_hf(family: str) -> None:
    model = perturbed(build(family)).eval()
    twin = hf_twin(model)
    assert list(model.state_dict()) == list(twin.state_dict())
    idx = tokens()
    logits = model(idx)
    assert isinstance(logits, torch.Tensor) and logits.shape == (3, T, VOCAB)
    torch.testing.assert_close(logits, twin(idx).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_model_dropout_fills_the_family_keys_and_drops_as_hf_does(family: str) -> None:
    cfg = model_cfg(family)
    cfg.dropout = 0.25
    model = build_hf_model(cfg, vocab_size=VOCAB)
    keys = {"llama": ["attention_dropout"], "gpt2": ["resid_pdrop", "embd_pdrop", "attn_pdrop"]}
    assert [getattr(model.config, k) for k in keys[family]] == [0.25] * len(keys[family])
    twin = hf_twin(model).train()
    idx = tokens()
    torch.manual_seed(11)
    logits = model.train()(idx)
    torch.manual_seed(11)
    torch.testing.assert_close(logits, twin(idx).logits, atol=1e-5, rtol=0)
    assert not torch.allclose(logits, model.eval()(idx))


@pytest.mark.parametrize("family", FAMILIES)
def test_pipeline_layers_applied_in_order_equal_forward(family: str) -> None:
    model = perturbed(build(family)).eval()
    x = idx = tokens()
    for layer in model.pipeline_layers():
        x = layer(x)
    torch.testing.assert_close(x, model(idx), atol=0, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_at_a_position_ignore_later_tokens(family: str) -> None:
    model = build(family).eval()
    idx = tokens()
    changed = idx.clone()
    changed[:, 8:] = (changed[:, 8:] + 1) % VOCAB
    before, after = model(idx), model(changed)
    torch.testing.assert_close(before[:, :8], after[:, :8], atol=0, rtol=0)
    assert not torch.allclose(before[:, 8:], after[:, 8:])


@pytest.mark.parametrize(
    ("family", "tie"), [("llama", None), ("llama", True), ("gpt2", None), ("gpt2", False)]
)
def test_layers_hold_each_parameter_once_and_a_tie_in_first_and_last(
    family: str, tie: bool | None
) -> None:
    model = build(family, **({} if tie is None else {"tie_word_embeddings": tie}))
    tied = model.config.tie_word_embeddings
    assert tied == (family == "gpt2" if tie is None else tie)  # the family's default
    layers = model.pipeline_layers()
    held = [{id(p) for p in layer.parameters()} for layer in layers]
    assert set().union(*held) == {id(p) for p in model.parameters()}  # references, no copies
    embedding = next(iter(layers[0].parameters()))
    shared = held[0] & held[-1]
    assert shared == ({id(embedding)} if tied else set())
    assert (model.get_parameter("lm_head.weight") is embedding) == tied
    blocks = layers[1:-1]
    assert len(blocks) == 2 and len({type(b) for b in blocks}) == 1
    assert all(type(layer) is not type(blocks[0]) for layer in (layers[0], layers[-1]))


@pytest.mark.parametrize("family", FAMILIES)
def test_pipeline_stages_run_the_model_and_merge_to_hf_keys(family: str) -> None:
    model = perturbed(build(family)).eval()
    layers = model.pipeline_layers()
    split = split_stages(layers, 2)
    stages = [StageModule(model, layers, held).eval() for held in split.layers]
    x = idx = tokens()
    for stage in stages:
        x = stage(x)
    torch.testing.assert_close(x, model(idx), atol=0, rtol=0)
    merged = {k: v for stage in stages for k, v in stage.state_dict().items()}
    assert sorted(merged) == sorted(model.state_dict())
    ties = tied_parameters(model, layers, split)
    assert [t.stages for t in ties] == ([(0, 1)] if model.config.tie_word_embeddings else [])


@pytest.mark.parametrize("family", FAMILIES)
def test_same_seed_builds_identical_weights_and_another_seed_differs(family: str) -> None:
    spec = {"model": {"kind": "hf", "hf": HF[family], "block_size": T}}
    cfg = config_from_dict(spec)
    vocab = cfg.data.vocab_size
    one, two, other = (
        build_model(cfg.model, vocab_size=vocab, seed=s).state_dict() for s in (3, 3, 4)
    )
    assert all(torch.equal(one[k], two[k]) for k in one)
    assert not torch.equal(one["lm_head.weight"], other["lm_head.weight"])


def loss_and_grads(model: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    idx = tokens()
    logits = model(idx[:, :-1].contiguous())
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), idx[:, 1:].reshape(-1))
    loss.backward()
    return loss.detach(), {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


@pytest.mark.parametrize("family", FAMILIES)
def test_activation_checkpointing_recomputes_blocks_with_the_same_loss_and_grads(
    family: str,
) -> None:
    plain = build(family, seed=1)
    cfg = model_cfg(family)
    cfg.activation_checkpointing = True
    checkpointed = build_model(cfg, vocab_size=VOCAB, seed=1)
    attention_calls = []
    for module in checkpointed.modules():
        if type(module).__name__.endswith("Attention"):
            module.register_forward_pre_hook(lambda *_: attention_calls.append(1))
    loss, grads = loss_and_grads(plain)
    loss_ckpt, grads_ckpt = loss_and_grads(checkpointed)
    assert len(attention_calls) == 2 * 2  # two blocks, each run again in the backward
    torch.testing.assert_close(loss_ckpt, loss, atol=0, rtol=0)
    assert grads_ckpt.keys() == grads.keys()
    for name in grads:
        torch.testing.assert_close(grads_ckpt[name], grads[name], atol=1e-6, rtol=1e-5)


def test_checkpoint_modules_can_name_the_hf_decoder_layer() -> None:
    model = build("llama")
    assert len(checkpoint_blocks(model, class_names=("LlamaDecoderLayer",))) == 2


@pytest.mark.parametrize("family", FAMILIES)
def test_export_pretrained_round_trips_through_from_pretrained(family: str, tmp_path: Path) -> None:
    model = perturbed(build(family)).eval()
    out = tmp_path / "export" / "hf"
    export_pretrained(
        model_cfg(family), vocab_size=VOCAB, weights=model.state_dict(), directory=out
    )
    assert "model.safetensors" in {p.name for p in out.iterdir()}
    assert [p.name for p in out.parent.iterdir()] == ["hf"]  # no temporary left behind
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    idx = tokens()
    torch.testing.assert_close(loaded(idx).logits, model(idx), atol=1e-6, rtol=0)


def test_export_pretrained_writes_into_an_empty_directory_and_refuses_a_full_one(
    tmp_path: Path,
) -> None:
    weights = build("gpt2").state_dict()
    export_pretrained(model_cfg("gpt2"), vocab_size=VOCAB, weights=weights, directory=tmp_path)
    with pytest.raises(ConfigError, match="not an empty directory") as err:
        export_pretrained(model_cfg("gpt2"), vocab_size=VOCAB, weights=weights, directory=tmp_path)
    assert "\n" not in str(err.value)


def test_export_pretrained_refuses_weights_of_another_model(tmp_path: Path) -> None:
    weights = build("gpt2", n_layer=3).state_dict()
    with pytest.raises(ConfigError, match=r"12 unexpected: transformer\.h\.2") as err:
        export_pretrained(model_cfg("gpt2"), vocab_size=VOCAB, weights=weights, directory=tmp_path)
    assert "\n" not in str(err.value)
    weights = build("gpt2", n_embd=16).state_dict()
    with pytest.raises(ConfigError, match="size mismatch") as err:
        export_pretrained(model_cfg("gpt2"), vocab_size=VOCAB, weights=weights, directory=tmp_path)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("family", FAMILIES)
def test_pretrained_starts_from_the_saved_weights(family: str, tmp_path: Path) -> None:
    saved = perturbed(build(family, seed=5))
    export_pretrained(
        model_cfg(family), vocab_size=VOCAB, weights=saved.state_dict(), directory=tmp_path
    )
    cfg = ModelConfig(kind="hf", pretrained=str(tmp_path), block_size=T, dropout=0.1)
    started = build_model(cfg, vocab_size=VOCAB, seed=9)
    assert isinstance(started, HFCausalLM)
    assert started.config.model_type == family
    state = started.state_dict()
    assert all(torch.equal(state[k], v) for k, v in saved.state_dict().items())
    dropout_key = {"llama": "attention_dropout", "gpt2": "resid_pdrop"}[family]
    assert getattr(started.config, dropout_key) == 0.1  # model.dropout overrides the saved one


def test_pretrained_takes_hf_keys_that_shape_no_weight(tmp_path: Path) -> None:
    export_pretrained(
        model_cfg("gpt2"), vocab_size=VOCAB, weights=build("gpt2").state_dict(), directory=tmp_path
    )
    cfg = ModelConfig(kind="hf", pretrained=str(tmp_path), hf={"attn_pdrop": 0.3}, block_size=T)
    assert build_hf_model(cfg, vocab_size=VOCAB).config.attn_pdrop == 0.3


def test_gpt2_takes_llama_style_names_for_its_keys() -> None:
    hf = {"model_type": "gpt2", "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2}
    config = build_hf_model(ModelConfig(kind="hf", hf=hf), vocab_size=VOCAB).config
    assert (config.n_embd, config.n_layer, config.n_head) == (16, 1, 2)


@pytest.fixture(scope="module")
def saved_gpt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("saved") / "gpt2"
    export_pretrained(
        model_cfg("gpt2"), vocab_size=VOCAB, weights=build("gpt2").state_dict(), directory=directory
    )
    return directory


def broken_weights(saved: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "broken"
    copy.mkdir()
    (copy / "config.json").write_text((saved / "config.json").read_text())
    (copy / "model.safetensors").write_bytes(b"not safetensors")
    return copy


MISTAKES: list[tuple[str, dict[str, Any], str]] = [
    ("not a causal LM", {"hf": {"model_type": "vit"}}, "'vit' is not a causal LM"),
    ("not an HF type", {"hf": {"model_type": "qwen9"}}, "did you mean qwen3, qwen2"),
    ("experts", {"hf": {**HF["llama"], "experts_implementation": "x"}}, "allowed: eager,"),
    ("unknown key", {"hf": {**HF["gpt2"], "intermediate_size": 64}}, "not a gpt2 config key"),
    ("typo", {"hf": {**HF["llama"], "hidden_sise": 32}}, "did you mean hidden_size"),
    ("alias twice", {"hf": {**HF["gpt2"], "hidden_size": 32}}, "sets n_embd twice"),
    ("bad type", {"hf": {**HF["gpt2"], "n_layer": "two"}}, "expected int"),
    ("HF validation", {"hf": {**HF["llama"], "hidden_size": 30}}, "not a multiple"),
    ("HF build", {"hf": {**HF["gpt2"], "n_embd": 30}}, "building gpt2 failed"),
    ("eager", {"hf": {**HF["llama"], "attn_implementation": "eager"}}, "allowed: sdpa"),
    ("dtype", {"hf": {**HF["llama"], "dtype": "bfloat16"}}, "train.precision"),
    ("vocab", {"hf": {**HF["llama"], "vocab_size": 10}}, "data.vocab_size"),
    ("cross attention", {"hf": {**HF["gpt2"], "add_cross_attention": True}}, "allowed: False"),
    ("positions", {"hf": {**HF["gpt2"], "n_positions": 8}}, "block_size=12 exceeds"),
    ("no such path", {"pretrained": "/nonexistent/model"}, "does not exist"),
    ("a file", {"pretrained": "FILE"}, "is not a directory"),
    ("no config", {"pretrained": "EMPTY"}, "has no config.json"),
    ("no weights", {"pretrained": "NO_WEIGHTS"}, "its weights do not load"),
    ("broken weights", {"pretrained": "BROKEN"}, "its weights do not load"),
    ("vocab mismatch", {"pretrained": "SAVED", "vocab": 50}, "set data.vocab_size=48"),
    ("family conflict", {"pretrained": "SAVED", "hf": {"model_type": "llama"}}, "but model"),
    ("shape change", {"pretrained": "SAVED", "hf": {"n_embd": 64}}, "mismatched: "),
    ("more layers", {"pretrained": "SAVED", "hf": {"n_layer": 3}}, "missing: transformer.h.2"),
]


@pytest.mark.parametrize(("what", "spec", "expected"), MISTAKES, ids=[m[0] for m in MISTAKES])
def test_each_mistake_is_one_config_error_line(
    what: str, spec: dict[str, Any], expected: str, saved_gpt2: Path, tmp_path: Path
) -> None:
    spec = dict(spec)
    vocab = spec.pop("vocab", VOCAB)
    place = spec.get("pretrained", "")
    if place == "FILE":
        (tmp_path / "file").write_text("x")
        spec["pretrained"] = str(tmp_path / "file")
    elif place == "EMPTY":
        spec["pretrained"] = str(tmp_path)
    elif place == "NO_WEIGHTS":
        (tmp_path / "config.json").write_text((saved_gpt2 / "config.json").read_text())
        spec["pretrained"] = str(tmp_path)
    elif place == "BROKEN":
        spec["pretrained"] = str(broken_weights(saved_gpt2, tmp_path))
    elif place == "SAVED":
        spec["pretrained"] = str(saved_gpt2)
    cfg = ModelConfig(kind="hf", block_size=T, **spec)
    with pytest.raises(ConfigError) as err:
        build_hf_model(cfg, vocab_size=vocab)
    message = str(err.value)
    assert expected in message
    assert "\n" not in message and len(message) < 600


def test_missing_transformers_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ConfigError, match=r"pip install 'trainstack\[hf\]'") as err:
        build_hf_model(model_cfg("llama"), vocab_size=VOCAB)
    assert "\n" not in str(err.value)


OTHERS: dict[str, dict[str, Any]] = {
    "qwen2": HF["llama"],
    "gemma3_text": {**HF["llama"], "head_dim": 8, "sliding_window": 4},  # windows < T
    "qwen3_moe": {
        **HF["llama"],
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
    },
    "gemma2": {**HF["llama"], "head_dim": 8},  # no sdpa in transformers: eager
}


@pytest.mark.parametrize("family", sorted(OTHERS))
def test_a_family_without_pipeline_layers_runs_its_own_forward(family: str) -> None:
    cfg = ModelConfig(kind="hf", hf={**OTHERS[family], "model_type": family}, block_size=T)
    model = build_model(cfg, vocab_size=VOCAB, seed=0)
    assert isinstance(model, HFCausalLM)
    model = perturbed(model).eval()
    twin = hf_twin(model)
    assert list(model.state_dict()) == list(twin.state_dict())  # HF's keys: exports as is
    idx = tokens()
    torch.testing.assert_close(model(idx), twin(idx).logits, atol=1e-5, rtol=0)
    # Its decoder layers (transformers' _no_split_modules) are the blocks FSDP shards
    # and activation checkpointing recomputes.
    blocks = repeated_blocks(model)
    assert [type(b).__name__ for b in blocks] == sorted(twin._no_split_modules) * 2
    if family == "gemma2":
        assert model.config._attn_implementation == "eager"


def test_an_moe_family_asked_for_its_router_logits_adds_its_weighted_balance_loss() -> None:
    """qwen3_moe with `output_router_logits`: the model returns its load-balancing loss
    times `router_aux_loss_coef` (what HF's own forward adds to its loss given labels),
    and the task's training loss is the cross-entropy plus that; without it, logits."""
    from trainstack.tasks import Task

    hf = {**OTHERS["qwen3_moe"], "model_type": "qwen3_moe"}
    plain = build_model(ModelConfig(kind="hf", hf=hf, block_size=T), vocab_size=VOCAB, seed=0)
    assert isinstance(plain(tokens()), torch.Tensor)
    hf |= {"output_router_logits": True, "router_aux_loss_coef": 0.05}
    model = build_model(ModelConfig(kind="hf", hf=hf, block_size=T), vocab_size=VOCAB, seed=0)
    assert isinstance(model, HFCausalLM)
    twin = hf_twin(model)
    idx = tokens()
    out = model(idx)
    theirs = twin(idx)
    assert float(theirs.aux_loss.detach()) > 0.5  # Switch's loss: about 1 when even, here E·Σ f·P
    torch.testing.assert_close(out.aux_loss, 0.05 * theirs.aux_loss, atol=1e-7, rtol=0)
    targets = tokens()
    task = Task(kind="lm", num_outputs=VOCAB)
    ce = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), targets.flatten())
    torch.testing.assert_close(task.loss(out, targets), ce + 0.05 * theirs.aux_loss)


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe"])
def test_a_family_that_runs_its_own_forward_goes_pretrained_in_trained_and_back_out(
    family: str, tmp_path: Path
) -> None:
    cfg = ModelConfig(kind="hf", hf={**OTHERS[family], "model_type": family}, block_size=T)
    saved = perturbed(build_model(cfg, vocab_size=VOCAB, seed=5))
    export_pretrained(cfg, vocab_size=VOCAB, weights=saved.state_dict(), directory=tmp_path / "in")
    pretrained = ModelConfig(kind="hf", pretrained=str(tmp_path / "in"), block_size=T)
    model = build_model(dataclasses.replace(pretrained, dropout=0.1), vocab_size=VOCAB, seed=9)
    assert isinstance(model, HFCausalLM) and model.config.attention_dropout == 0.1
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.state_dict().items())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idx = tokens()
    for _ in range(3):
        F.cross_entropy(model(idx)[:, :-1].flatten(0, 1), idx[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    moved = max(
        (model.state_dict()[k] - v).abs().max().item() for k, v in saved.state_dict().items()
    )
    assert moved > 1e-3  # trained: the round trip below is of new weights
    export_pretrained(
        pretrained, vocab_size=VOCAB, weights=model.state_dict(), directory=tmp_path / "out"
    )
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", local_files_only=True
    )
    torch.testing.assert_close(loaded.eval()(idx).logits, model(idx), atol=1e-6, rtol=0)


PLAN_WIDTHS = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def plan_model(family: str, **hf: Any) -> Any:
    falcon = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}
    widths = PLAN_WIDTHS if family != "falcon" else falcon
    raw = {
        "model": {"kind": "hf", "hf": {"model_type": family, **widths, **hf}, "block_size": 16},
        "data": {"vocab_size": 16},
    }
    return build_model(config_from_dict(raw).model, vocab_size=16, seed=0)


@pytest.mark.parametrize(
    ("family", "hf"),
    [
        ("qwen3", {}),
        ("phi3", {}),
        ("gemma3_text", {"head_dim": 8}),
        ("qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}),
    ],
)
def test_pipeline_layers_from_the_familys_plan_compute_its_own_forward(
    family: str, hf: dict[str, Any]
) -> None:
    model = plan_model(family, **hf).eval()
    layers = model.pipeline_layers()  # checked against the family's forward on first build
    assert len(layers) == 2 + 2 and type(layers[1]).__name__ == "PlanLayer"
    x = torch.randint(16, (2, 16), generator=torch.Generator().manual_seed(1))
    h = x
    with torch.no_grad():
        for layer in layers:
            h = layer(h)
        own = model(x)
    assert float((h - getattr(own, "logits", own)).abs().max()) <= 1e-5


@pytest.mark.parametrize(
    ("family", "hf", "words"),
    [
        ("gemma2", {"head_dim": 8}, "its base_model_pp_plan's layers in order differ from its"),
        ("mistral", {"sliding_window": 8}, "a sliding window shorter than model.block_size"),
        ("falcon", {}, "its config's base_model_pp_plan (none) and the model's _pp_plan are not"),
        (
            "mixtral",
            {"num_local_experts": 4, "output_router_logits": True},
            "output_router_logits=true with a pipeline: mixtral's balance loss",
        ),
    ],
)
def test_a_family_whose_plan_does_not_compute_its_forward_is_refused_for_a_pipeline(
    family: str, hf: dict[str, Any], words: str
) -> None:
    model = plan_model(family, **hf)
    pipeline = config_from_dict(
        {
            "train": {"global_batch_size": 8, "micro_batch_size": 2},
            "strategy": {"kind": "pipeline", "stages": 2},
            "scaling": {"num_workers": 2},
        }
    )
    with pytest.raises(ConfigError) as refused:  # what pre-flight and the stages call
        check_pipeline_model(pipeline, model)
    assert words in str(refused.value) and "\n" not in str(refused.value), str(refused.value)


@pytest.mark.parametrize(
    ("family", "hf", "degree", "words"),
    [
        (  # multi-head latent attention (DeepSeek's): a style trainstack does not split
            "minicpm3",
            {},
            2,
            "splits layers.*.self_attn.kv_a_proj_with_mqa as mla_kv_a_proj, which trainstack",
        ),
        (  # its experts split by the intermediate size, which the degree must divide
            "qwen3_moe",
            {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 33},
            2,
            "tensor_parallel=2 does not divide qwen3_moe's mlp.experts intermediate size = 33",
        ),
        (
            "mixtral",
            {"num_local_experts": 4, "intermediate_size": 63},
            2,
            "does not divide mixtral's mlp.experts intermediate size = 63",
        ),
        ("qwen3", {}, 4, "tensor_parallel=4 does not divide qwen3's num_key_value_heads = 2"),
        ("qwen2", {}, 3, "tensor_parallel=3 does not divide qwen2's vocab_size = 16"),
        (
            "qwen2",
            {"intermediate_size": 65},
            2,
            "does not divide qwen2's mlp.gate_proj.out_features = 65",
        ),
    ],
)
def test_a_tensor_parallel_plan_trainstack_cannot_apply_is_refused_in_one_line(
    family: str, hf: dict[str, Any], degree: int, words: str
) -> None:
    from trainstack.strategies.tensor_parallel import check_tensor_parallel

    model = plan_model(family, **hf)
    with pytest.raises(ConfigError) as refused:
        check_tensor_parallel(model, degree)
    assert words in str(refused.value) and "\n" not in str(refused.value), str(refused.value)
    for applies in ("olmo2", "qwen3"):  # plans that apply (per-head norms too), sizes that divide
        check_tensor_parallel(plan_model(applies), 2)
    for family, experts in MIXTURES.items():  # stacked experts split inside
        check_tensor_parallel(plan_model(family, **experts), 2)


MIXTURES: dict[str, dict[str, Any]] = {
    "mixtral": {"num_local_experts": 4},
    "qwen2_moe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
    },
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
}
"""Tiny mixtures of experts whose plans split their stacked experts (`moe_tp_experts`)."""


def test_stacked_experts_split_otherwise_are_refused_in_one_line() -> None:
    """A `moe_tp_experts` module whose plan splits its gate_up_proj column-wise (some
    families' separate layout) is not what `ExpertsParallel` does: refused, not misapplied."""
    from trainstack.strategies.tensor_parallel import check_tensor_parallel

    model = plan_model("mixtral", num_local_experts=4)
    plan = dict(model.config.base_model_tp_plan)
    model.config.base_model_tp_plan = {**plan, "layers.*.mlp.experts.gate_up_proj": "colwise"}
    with pytest.raises(ConfigError) as refused:
        check_tensor_parallel(model, 2)
    words = "layers.*.mlp.experts as moe_tp_experts with mlp.experts.gate_up_proj: colwise"
    assert words in str(refused.value) and "\n" not in str(refused.value), str(refused.value)
