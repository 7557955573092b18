"""Hugging Face causal-LM families without pipeline layers in trainstack run their own
forward and train like any model: tiny random configs (nothing downloaded) of dense
GQA models (qwen2, mistral), ones with norms on queries and keys (qwen3 per head, olmo2
over the width), one with fused projections (phi3) and a mixture of experts (mixtral).
(Gemma's norms compute in float32 whatever the weights' precision, so a float64 bound
does not hold for it where a layout sums in another order: it is held to HF's own forward
in tests/unit/test_hf_models.py, and under tensor parallelism, in float32, to its
reference's own float32 noise.)
DDP on 2 workers = one process in float64; FSDP2 over the family's `_no_split_modules`
blocks = one process for two dense models (qwen2, olmo2) and the mixture of experts; a
2-stage pipeline cut by the family's own `base_model_pp_plan` = one process for qwen2,
olmo2 and the mixture of experts (its balance loss off: a pipeline's stages do not
gather it); tensor
parallelism over 2 ranks by the family's own `base_model_tp_plan` = one process for
qwen2 (column/row), qwen3 (its per-head q/k norms replicated, each one's weight gradient
summed over the ranks; also FSDP 2 × tensor parallel 2), olmo2, phi3 (fused
projections gathered, then split) and mixtral (each expert split by its intermediate
size, its packed gate and up projections sliced half by half, with its balance loss;
also FSDP 2 × tensor parallel 2, and the tensor parallel 2 checkpoint resumed there:
the full weights compared, the packed gate_up_proj among them, come whole from the
run's sharded checkpoint). The qwen2 and mixtral runs
under tensor parallelism and qwen2's pipeline export (`trainstack export --hf-dir`) to
folders transformers loads with the trained logits."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from trainstack.config import config_from_dict
from trainstack.models import build_model, repeated_blocks
from trainstack.runtime.gloo_processes import run_processes

from bounds import (
    FP64_BOUND,
    assert_trained,
    float32_sensitivity,
    max_difference,
    one_process,
    sensitivity_bound,
)
from user_model_specs import HF_WIDTHS

STEPS = 6
WIDTHS = HF_WIDTHS
FAMILIES: dict[str, dict[str, Any]] = {
    "qwen2": WIDTHS,
    "qwen3": WIDTHS,  # norms on each head's queries and keys
    "mistral": WIDTHS,
    "olmo2": WIDTHS,
    "phi3": WIDTHS,
    # the eager experts: grouped matmuls take no float64; its balance loss in the training
    # loss (output_router_logits), so every layout below is held to it too
    "mixtral": {
        **WIDTHS,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "experts_implementation": "eager",
        "output_router_logits": True,
        "router_aux_loss_coef": 0.05,
    },
}
FLOAT32_NORMED = {"gemma3_text": {**WIDTHS, "head_dim": 8}}
"""Families whose norms compute in float32 whatever the weights' precision."""


def spec(family: str, storage: Path, *, strategy: str = "ddp", workers: int = 1) -> dict[str, Any]:
    return {
        "name": f"{family}-{strategy}{workers}",
        "model": {
            "kind": "hf",
            "hf": {"model_type": family, **{**FAMILIES, **FLOAT32_NORMED}[family]},
            "block_size": 16,
        },
        "data": {"vocab_size": 16, "order": 1, "eval_samples": 16},
        "train": {
            "steps": STEPS,
            "global_batch_size": 8,
            # the same micro-batches of 4 on 1 or 2 workers: a balance loss is per micro-batch
            "micro_batch_size": 4,
            "precision": "fp64",
        },
        "optim": {"lr": 1e-2, "warmup_steps": 2, "grad_clip": 1.0},
        "strategy": {"kind": strategy},
        "scaling": {"num_workers": workers},
        "checkpoint": {"every_steps": STEPS, "storage_path": str(storage)},
        "log": {"every_steps": STEPS},
    }


_REFERENCES: dict[str, dict[str, torch.Tensor]] = {}


def reference_of(raw: dict[str, Any], out: Path) -> dict[str, torch.Tensor]:
    """`raw` trained by one process, once per model and training (its layout, name and
    storage do not change what one process trains)."""
    key = json.dumps({k: raw[k] for k in ("model", "data", "train", "optim")}, sort_keys=True)
    if key not in _REFERENCES:
        _REFERENCES[key] = one_process(raw, out)
    return _REFERENCES[key]


def weights_after(raw: dict[str, Any], out: Path) -> dict[str, torch.Tensor]:
    """`raw` trained on its workers; the final weights rank 0 leaves in `out`."""
    run_processes(config_from_dict(raw), world_size=raw["scaling"]["num_workers"], out_dir=out)
    weights: dict[str, torch.Tensor] = torch.load(out / "model.pt", weights_only=True)
    return weights


@pytest.mark.parametrize("family", list(FAMILIES))
def test_ddp_on_two_workers_matches_one_process(family: str, tmp_path: Path) -> None:
    reference = reference_of(spec(family, tmp_path / "one"), tmp_path / "one-out")
    assert_trained(reference, spec(family, tmp_path / "one"))
    two = weights_after(spec(family, tmp_path / "two", workers=2), tmp_path / "two-out")
    diff = max_difference(two, reference)
    print(f"{family} ddp 2 vs one process: {diff:.3g}")
    assert diff < FP64_BOUND


@pytest.mark.parametrize("family", ["qwen2", "olmo2", "mixtral"])
def test_fsdp_over_the_familys_blocks_matches_one_process(family: str, tmp_path: Path) -> None:
    model = build_model(config_from_dict(spec(family, tmp_path)).model, vocab_size=16, seed=0)
    blocks = repeated_blocks(model)  # the FSDP units: the decoder layers transformers names
    assert [type(b).__name__ for b in blocks] == [*model._hf._no_split_modules] * 2  # type: ignore[misc]
    reference = reference_of(spec(family, tmp_path / "one"), tmp_path / "one-out")
    sharded = weights_after(
        spec(family, tmp_path / "fsdp", strategy="fsdp", workers=2), tmp_path / "fsdp-out"
    )
    diff = max_difference(sharded, reference)
    print(f"{family} fsdp 2 vs one process: {diff:.3g}")
    assert diff < FP64_BOUND


def test_mixtrals_experts_split_over_two_ranks_train_what_one_process_trains(
    tmp_path: Path,
) -> None:
    """`strategy.expert_parallel: 2` on Mixtral's stacked experts: each rank keeps 2 of
    the 4 (its `MixtralExperts` parameters sliced), tokens go to their experts' rank by
    all-to-all and run through Mixtral's own expert forward there; the checkpoint holds
    all 4 again."""
    reference = reference_of(spec("mixtral", tmp_path / "one"), tmp_path / "one-out")
    raw = spec("mixtral", tmp_path / "ep", workers=2)
    raw["strategy"]["expert_parallel"] = 2
    split = weights_after(raw, tmp_path / "ep-out")
    assert split["model.layers.0.mlp.experts.gate_up_proj"].shape[0] == 4
    diff = max_difference(split, reference)
    print(f"mixtral ep2 vs one process: {diff:.3g}")
    assert diff < FP64_BOUND


@pytest.mark.parametrize("family", ["qwen2", "olmo2", "mixtral"])
def test_a_pipeline_cut_by_the_familys_plan_matches_one_process(
    family: str, tmp_path: Path
) -> None:
    """Stages from `base_model_pp_plan` (embedding | 2 decoder blocks | norm and head),
    1F1B over 2 micro-batches of 4: the same micro-batches one process accumulates."""
    raw = spec(family, tmp_path / "pp", strategy="pipeline", workers=2)
    if family == "mixtral":
        raw["model"]["hf"] = {**raw["model"]["hf"], "output_router_logits": False}
    raw["strategy"].update(stages=2, microbatches=2)
    reference = reference_of(raw, tmp_path / "one-out")
    assert_trained(reference, raw)
    staged = weights_after(raw, tmp_path / "pp-out")
    diff = max_difference(staged, reference)
    print(f"{family} pipeline 2 vs one process: {diff:.3g}")
    assert diff < FP64_BOUND
    if family == "qwen2":
        assert_exported_logits(raw, staged, tmp_path / "export")


@pytest.mark.parametrize(
    ("family", "workers"),
    [
        ("qwen2", 2),
        ("qwen3", 2),
        ("qwen3", 4),
        ("olmo2", 2),
        ("phi3", 2),
        ("mixtral", 2),
        ("mixtral", 4),
    ],
)
def test_tensor_parallel_by_the_familys_plan_matches_one_process(
    family: str, workers: int, tmp_path: Path
) -> None:
    """Tensor parallel 2, and for qwen3 and mixtral also FSDP 2 × tensor parallel 2 on 4
    workers. qwen3: its per-head q/k norms' weight gradients, summed over the tp ranks by
    the optimizer's DTensor ops in the first and by FSDP2's reduction in the second.
    mixtral: its experts' outputs summed over the tp ranks in the forward pass, the
    gradients their slices give the hidden states and the routing weights in the
    backward (the router's then whole); its export loads into transformers."""
    raw = spec(family, tmp_path / "tp", strategy="fsdp", workers=workers)
    raw["strategy"]["tensor_parallel"] = 2
    reference = reference_of(raw, tmp_path / "one-out")
    split = weights_after(raw, tmp_path / "tp-out")
    diff = max_difference(split, reference)
    print(f"{family} fsdp {workers // 2} x tp 2 vs one process: {diff:.3g}")
    assert diff < FP64_BOUND
    if (family, workers) in (("qwen2", 2), ("mixtral", 2)):
        assert_exported_logits(raw, split, tmp_path / "export")


@pytest.mark.slow
def test_mixtrals_tensor_parallel_checkpoint_resumes_under_fsdp_2_x_tensor_parallel_2(
    tmp_path: Path,
) -> None:
    """Tensor parallel 2's checkpoint at step 3 (each rank's two blocks of every packed
    gate_up_proj and of its Adam moments, checkpoint/blocks.py) read by FSDP 2 × tensor
    parallel 2 on 4 workers, which finishes the run as one process does: Adam's moments
    restarted, or blocks read to the wrong rows, land 1e-2 and more away."""
    from trainstack import checkpoint as ckpt

    raw = spec("mixtral", tmp_path / "tp", strategy="fsdp", workers=2)
    raw["strategy"]["tensor_parallel"] = 2
    raw["checkpoint"]["every_steps"] = 3
    reference = reference_of(raw, tmp_path / "one-out")
    run_processes(config_from_dict(raw), world_size=2, out_dir=tmp_path / "tp-out")
    step_3 = ckpt.run_dir_for(config_from_dict(raw)) / ckpt.dir_name(3)
    wider = spec("mixtral", tmp_path / "wider", strategy="fsdp", workers=4)
    wider["strategy"]["tensor_parallel"] = 2
    summary = run_processes(
        config_from_dict(wider), world_size=4, out_dir=tmp_path / "wider-out", resume_from=step_3
    )
    assert summary["resumed_from_step"] == 3
    resumed = torch.load(tmp_path / "wider-out" / "model.pt", weights_only=True)
    diff = max_difference(resumed, reference)
    print(f"mixtral tp 2 -> fsdp 2 x tp 2 at step 3 vs one process: {diff:.3g}")
    assert diff < FP64_BOUND


def test_gemma3s_per_head_norms_under_tensor_parallel_land_within_its_float32_noise(
    tmp_path: Path,
) -> None:
    """gemma3_text's q/k norms over each rank's heads, tensor parallel 2. Gemma's norms
    compute in float32 whatever the weights' precision, and a norm's weight gradient is
    summed over a rank's heads in float32 before the ranks' sums are added, so even in
    float64 this layout lands 1.3e-8 from one process, past FP64_BOUND (DDP: 0). Held in
    float32 to the reference's own float32 sensitivity instead (tests/bounds.py), which
    leaving the gradient unsummed over the ranks misses by 1000 times (0.046)."""
    raw = spec("gemma3_text", tmp_path / "tp", strategy="fsdp", workers=2)
    raw["strategy"]["tensor_parallel"] = 2
    raw["train"]["precision"] = "fp32"
    reference, sensitivity = float32_sensitivity(raw, tmp_path / "one")
    assert_trained(reference, raw)
    split = weights_after(raw, tmp_path / "tp-out")
    diff = max_difference(split, reference)
    print(f"gemma3_text tp 2 vs one process in float32: {diff:.3g}")
    assert diff < sensitivity_bound(sensitivity)


def assert_exported_logits(
    raw: dict[str, Any], trained: dict[str, torch.Tensor], out: Path
) -> None:
    """`trainstack export` of the run's last checkpoint: transformers loads the folder and
    computes the trained weights' logits (not the initial ones')."""
    from transformers import AutoModelForCausalLM

    from trainstack import checkpoint as ckpt
    from trainstack.cli import main

    cfg = config_from_dict(raw)
    final = ckpt.run_dir_for(cfg) / ckpt.dir_name(STEPS)
    assert (
        main(["export", str(final), "--out", str(out / "m.pt"), "--hf-dir", str(out / "hf")]) == 0
    )
    eager = {k: v for k, v in raw["model"]["hf"].items() if k == "experts_implementation"}
    loaded = AutoModelForCausalLM.from_pretrained(out / "hf", **eager).eval()  # float64 experts
    model = build_model(cfg.model, vocab_size=16, seed=0).to(torch.float64).eval()

    def logits(x: torch.Tensor) -> torch.Tensor:
        outputs = model(x)
        return getattr(outputs, "logits", outputs)  # beside a balance loss, where there is one

    initial = logits(x := torch.randint(16, (2, 16)))
    model.load_state_dict(trained)
    with torch.no_grad():
        ours, theirs = logits(x), loaded.to(torch.float64)(input_ids=x).logits
    print(f"exported logits vs trained: {float((theirs - ours).abs().max()):.3g}")
    assert torch.allclose(theirs, ours, atol=1e-5, rtol=0)  # the folder holds fp32 weights
    assert not torch.allclose(theirs, initial, atol=1e-3, rtol=0)
