"""LoRA (`model.lora`, by peft): adapters over frozen weights train under DDP, FSDP2 and
ZeRO-2/3 what one process trains, for trainstack's GPT, a user's own module (its layers
named) and a Hugging Face family started from a pretrained folder. DDP and FSDP in
float64 (10 steps, each killed once and resumed from a checkpoint that keeps the
adapters alone); ZeRO in float32, against the one-process
reference's own float32 sensitivity. Every frozen weight ends where it started, bit for
bit; the adapters moved. The Hugging Face run's adapters, exported as a peft adapter
folder, load with `peft.PeftModel.from_pretrained` over transformers' own model and give
trainstack's logits; merged (`--merge --hf-dir`), the folder transformers loads gives them
too. Gloo processes, no Ray."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from trainstack import checkpoint as ckpt
from trainstack.checkpoint.pretrained import folder_fingerprint
from trainstack.cli.app import main
from trainstack.config import config_from_dict
from trainstack.models import build_model
from trainstack.models.lora import is_adapter_key
from trainstack.planner.layouts import Layout
from trainstack.planner.memory import model_state_bytes
from trainstack.planner.workload import state_element_bytes, trainable_parameter_count
from trainstack.runtime.gloo_processes import run_processes

from bounds import (
    FP64_BOUND,
    float32_sensitivity,
    initial_weights,
    max_difference,
    one_process,
    sensitivity_bound,
)
from user_model_specs import HF_WIDTHS, MODELS

STEPS = 10
VOCAB = 16


def gpt_spec(storage: Path, *, precision: str = "fp64") -> dict[str, Any]:
    return {
        "name": "lora",
        "model": {
            "kind": "gpt",
            "n_layer": 2,
            "n_head": 2,
            "n_embd": 32,
            "block_size": 16,
            "lora": {"rank": 4, "alpha": 8},
        },
        "data": {"vocab_size": VOCAB, "order": 1, "eval_samples": 16},
        "train": {
            "steps": STEPS,
            "global_batch_size": 16,
            "micro_batch_size": 4,
            "precision": precision,
        },
        "optim": {"lr": 1e-2, "warmup_steps": 2},
        "checkpoint": {"storage_path": str(storage), "every_steps": 5, "keep": 10},
        "log": {"every_steps": 5},
    }


def on_two(raw: dict[str, Any], strategy: dict[str, Any], out: Path) -> dict[str, torch.Tensor]:
    """`raw` under `strategy` on two gloo ranks; its final weights (its summary beside
    them, in `out`)."""
    spec = {**copy.deepcopy(raw), "strategy": strategy, "scaling": {"num_workers": 2}}
    spec["checkpoint"]["storage_path"] = str(out / "runs")
    run_processes(config_from_dict(spec), world_size=2, out_dir=out)
    weights: dict[str, torch.Tensor] = torch.load(out / "model.pt", weights_only=True)
    return weights


def assert_planned_memory(
    raw: dict[str, Any], layout: Layout, out: Path, *, within: float = 0.02
) -> None:
    """The model state rank 0 measured is what the planner counts with the adapters
    alone trained (frozen weights held, no gradient or optimizer state for them); a
    planner counting every parameter as trained would be off by several times."""
    summary = json.loads((out / "summary.json").read_text())
    measured = sum(summary["model_state_bytes"].values())
    cfg = config_from_dict(raw)
    element, optimizer, weight = state_element_bytes(cfg)
    planned = model_state_bytes(
        layout,
        params=summary["params"],
        element_bytes=element,
        optimizer_bytes=optimizer,
        weight_bytes=weight,
        trainable=trainable_parameter_count(cfg),
    ).total
    assert abs(measured - planned) <= within * planned, (measured, planned)


def assert_only_adapters_moved(weights: dict[str, torch.Tensor], raw: dict[str, Any]) -> None:
    """Every frozen weight is where it started, bit for bit; the adapters moved (an
    untrained run's B is still zero)."""
    start = initial_weights(raw)
    adapters = [k for k in weights if is_adapter_key(k)]
    assert adapters and len(adapters) < len(weights)
    for key, value in weights.items():
        if not is_adapter_key(key):
            assert torch.equal(value.to(start[key].dtype), start[key]), key
    moved = max((weights[k].double() - start[k].double()).abs().max().item() for k in adapters)
    assert moved > 1e-2, f"the adapters moved by {moved:.3g} only"


@pytest.fixture(scope="module")
def gpt_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    out = tmp_path_factory.mktemp("lora-reference")
    raw = gpt_spec(out)
    weights = one_process(raw, out)
    assert_only_adapters_moved(weights, raw)
    return weights


@pytest.mark.parametrize("kind", ["ddp", "fsdp", "pipeline"])
def test_gpt_adapters_under_ddp_fsdp_and_a_pipeline_train_what_one_process_trains(
    tmp_path: Path, gpt_reference: dict[str, torch.Tensor], kind: str
) -> None:
    """Each is killed before step 7 and resumed from checkpoint 5 (the adapters and
    their optimizer state, over the base the seed rebuilds) on the way. The pipeline
    cuts the GPT into 2 stages, the frozen tied embedding and head on both."""
    raw = gpt_spec(tmp_path)
    raw["faults"] = {"kill_at_steps": [7], "rank": 1}
    strategy: dict[str, Any] = {"kind": kind}
    layout, within = Layout(kind=kind, devices=2), 0.02
    if kind == "pipeline":
        # the planner splits the model evenly over the stages; each holds a copy of the
        # tied embedding (3% of this model's state): the 10% the planner's pipeline
        # tests allow
        strategy.update(stages=2, microbatches=4)
        layout, within = Layout(kind=kind, devices=2, stages=2), 0.10
    with pytest.raises(Exception, match="exit code 17"):
        on_two(raw, strategy, tmp_path / kind)
    weights = on_two(raw, strategy, tmp_path / kind)
    assert_planned_memory(raw, layout, tmp_path / kind, within=within)
    saved = ckpt.resolve(tmp_path / kind / "runs" / "lora")
    assert saved.manifest["lora"] == {"seed": 0}  # the base: the GPT built from the seed
    assert sorted(saved.full_weights()) == sorted(k for k in weights if is_adapter_key(k))
    diff = max_difference(weights, gpt_reference)
    print(f"max |lora {kind} x 2 - one process| = {diff:.3g}")
    assert diff < FP64_BOUND
    assert_only_adapters_moved(weights, raw)


def test_gpt_adapters_under_fsdp_2_x_tensor_parallel_2_train_what_one_process_trains(
    tmp_path: Path, gpt_reference: dict[str, torch.Tensor]
) -> None:
    """Each projection's adapters split as its base layer is (A and B column-parallel
    under a column-parallel base; A row-parallel, B replicated under a row-parallel one),
    the frozen norms replicated and still frozen; killed before step 7 and resumed from
    checkpoint 5's DCP shards of the adapters."""
    raw = gpt_spec(tmp_path)
    raw["faults"] = {"kill_at_steps": [7], "rank": 1}
    raw["model"]["lora"]["target_modules"] = ["q_proj", "v_proj", "c_proj"]  # col and row
    spec = {**copy.deepcopy(raw), "strategy": {"kind": "fsdp", "tensor_parallel": 2}}
    spec["scaling"] = {"num_workers": 4}
    spec["checkpoint"]["storage_path"] = str(tmp_path / "tp" / "runs")
    out = tmp_path / "tp"
    with pytest.raises(Exception, match="exit code 17"):
        run_processes(config_from_dict(spec), world_size=4, out_dir=out)
    run_processes(config_from_dict(spec), world_size=4, out_dir=out)
    weights: dict[str, torch.Tensor] = torch.load(out / "model.pt", weights_only=True)
    # the planner splits every parameter 4 ways; the norms and a row-parallel base's B are
    # replicated over tp (split 2 ways): 7% of this tiny model's state, within the 10% the
    # planner's tensor-parallel tests allow
    layout = Layout(kind="fsdp", devices=4, tensor_parallel=2)
    assert_planned_memory(raw, layout, out, within=0.10)
    reference = one_process(raw, tmp_path / "one")
    diff = max_difference(weights, reference)
    print(f"max |lora fsdp 2 x tp 2 - one process| = {diff:.3g}")
    assert diff < FP64_BOUND
    assert_only_adapters_moved(weights, raw)
    assert any(".c_proj.lora_B." in k for k in weights)  # a row-parallel base adapted too


@pytest.fixture(scope="module")
def gpt_float32(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, torch.Tensor], float]:
    out = tmp_path_factory.mktemp("lora-float32")
    return float32_sensitivity(gpt_spec(out, precision="fp32"), out)


@pytest.mark.parametrize("stage", [2, 3])
def test_gpt_adapters_under_zero_train_what_one_process_trains(
    tmp_path: Path, gpt_float32: tuple[dict[str, torch.Tensor], float], stage: int
) -> None:
    """Killed before step 7 and resumed from checkpoint 5 too."""
    reference, sensitivity = gpt_float32
    raw = gpt_spec(tmp_path, precision="fp32")
    raw["faults"] = {"kill_at_steps": [7], "rank": 1}
    strategy = {"kind": "zero", "stage": stage}
    with pytest.raises(Exception, match="exit code 17"):
        on_two(raw, strategy, tmp_path / f"zero{stage}")
    weights = on_two(raw, strategy, tmp_path / f"zero{stage}")
    assert_planned_memory(
        raw, Layout(kind="zero", devices=2, stage=stage), tmp_path / f"zero{stage}"
    )
    diff = max_difference(weights, reference)
    print(f"max |lora zero-{stage} x 2 - one process| = {diff:.3g} (sensitivity {sensitivity:.3g})")
    assert diff < sensitivity_bound(sensitivity)
    assert_only_adapters_moved(weights, raw)


def test_a_users_module_trains_adapters_on_the_layers_it_names(tmp_path: Path) -> None:
    raw = {
        **copy.deepcopy(MODELS["transformer"]),
        "name": "lora-custom",
        "train": {
            "steps": STEPS,
            "global_batch_size": 16,
            "micro_batch_size": 4,
            "precision": "fp64",
        },
        "optim": {"lr": 1e-2, "warmup_steps": 2},
        "checkpoint": {"storage_path": str(tmp_path)},
        "log": {"every_steps": 5},
    }
    raw["model"]["lora"] = {"rank": 2, "target_modules": ["qkv", "down"]}
    reference = one_process(raw, tmp_path / "reference")
    weights = on_two(raw, {"kind": "ddp"}, tmp_path / "ddp")
    assert max_difference(weights, reference) < FP64_BOUND
    assert_only_adapters_moved(weights, raw)
    adapted = {k.split(".lora_")[0] for k in weights if is_adapter_key(k)}
    assert {name.rsplit(".", 1)[-1] for name in adapted} == {"qkv", "down"}


def with_base(raw: dict[str, Any], folder: Path) -> dict[str, Any]:
    return {**raw, "model": {**raw["model"], "pretrained": str(folder)}}


@pytest.fixture(scope="module")
def qwen2_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A save_pretrained qwen2 in float64: the base the adapters are trained over."""
    import transformers

    path = tmp_path_factory.mktemp("pretrained") / "qwen2"
    config = transformers.Qwen2Config(vocab_size=VOCAB, **HF_WIDTHS)
    torch.manual_seed(3)
    transformers.AutoModelForCausalLM.from_config(config).double().save_pretrained(path)
    return path


def test_hf_adapters_from_a_pretrained_folder_train_and_load_in_peft(
    tmp_path: Path, qwen2_folder: Path
) -> None:
    import peft
    import transformers

    raw = {
        "name": "lora-qwen2",
        "model": {
            "kind": "hf",
            "pretrained": str(qwen2_folder),
            "block_size": 16,
            "lora": {"rank": 4, "alpha": 16},  # peft's targets for qwen2: q_proj, v_proj
        },
        "data": {"vocab_size": VOCAB, "order": 1, "eval_samples": 16},
        "train": {
            "steps": STEPS,
            "global_batch_size": 16,
            "micro_batch_size": 4,
            "precision": "fp64",
        },
        "optim": {"lr": 1e-2, "warmup_steps": 2},
        "checkpoint": {"storage_path": str(tmp_path / "runs")},
        "log": {"every_steps": 5},
    }
    reference = one_process(raw, tmp_path / "reference")
    weights = on_two(raw, {"kind": "fsdp"}, tmp_path / "fsdp")
    assert max_difference(weights, reference) < FP64_BOUND
    assert_only_adapters_moved(weights, raw)

    cfg = config_from_dict(raw)
    trained = build_model(cfg.model, vocab_size=VOCAB, seed=0).double()
    trained.load_state_dict(weights)
    tokens = torch.randint(VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = trained.eval()(tokens)

    run = tmp_path / "fsdp" / "runs" / "lora-qwen2"
    # The checkpoint keeps the adapters alone (DCP's shards of them) and names its base.
    final = ckpt.resolve(run)
    kept = final.full_weights()
    assert kept and all(is_adapter_key(k) for k in kept)
    assert final.manifest["lora"]["fingerprint"] == folder_fingerprint(qwen2_folder)
    moved = Path(shutil.copytree(qwen2_folder, tmp_path / "moved"))  # the same base
    ckpt.check_same_base(final, config_from_dict(with_base(raw, moved)))
    other = tmp_path / "other"
    torch.manual_seed(4)
    transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(qwen2_folder)
    ).double().save_pretrained(other)
    with pytest.raises(ckpt.CheckpointError) as refused:
        ckpt.check_same_base(final, config_from_dict(with_base(raw, other)))
    assert "holds LoRA adapters trained over" in str(refused.value)
    assert "\n" not in str(refused.value)
    adapter_dir, merged_dir = tmp_path / "adapter", tmp_path / "merged"
    assert main(["export", str(run), "--adapter-dir", str(adapter_dir)]) == 0
    assert main(["export", str(run), "--out", str(tmp_path / "x.pt"), "--hf-dir", "hf"]) == 2
    out = tmp_path / "merged.pt"
    assert (
        main(["export", str(run), "--out", str(out), "--merge", "--hf-dir", str(merged_dir)]) == 0
    )
    base = transformers.AutoModelForCausalLM.from_pretrained(qwen2_folder, dtype=torch.float64)
    with torch.no_grad():
        untuned = base.eval()(tokens).logits
        adapted = peft.PeftModel.from_pretrained(base, adapter_dir).eval()(tokens).logits
    assert (adapted - untuned).abs().max() > 1e-3  # the adapters change the logits ...
    assert torch.allclose(adapted, expected, rtol=0, atol=1e-10)  # ... to trainstack's
    # The merged folder holds float32 weights (an export's dtype): the merged state dict,
    # rounded to float32, in the model without adapters gives its logits exactly.
    merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float64)
    plain = config_from_dict({**raw, "model": {**raw["model"], "lora": {}}})
    rounded = build_model(plain.model, vocab_size=VOCAB, seed=0).double()
    folded = torch.load(out, weights_only=True)
    assert not any(is_adapter_key(k) for k in folded)
    rounded.load_state_dict({k: v.float().double() for k, v in folded.items()})
    with torch.no_grad():
        loaded = merged.eval()(tokens).logits
        assert torch.allclose(loaded, rounded.eval()(tokens), rtol=0, atol=1e-10)
        assert torch.allclose(loaded, expected, rtol=0, atol=1e-6)  # float32's rounding
