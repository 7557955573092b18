"""Layouts on one device mesh (FSDP2, HSDP, tensor parallel, and pipelines with tensor-
parallel stages): every layout trains what one process trains, resumes bitwise after a
killed worker, and hands its checkpoint to another layout (optimizer state included)
that continues as if nothing had changed.

The runs train in float64 (`tests/bounds.py`): every layout lands within
`FP64_BOUND` of one process on any CPU, where a skipped all-reduce or a wrong shard offset
lands 1e-4 or more away."""

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from trainstack import checkpoint as ckpt
from trainstack.compat import torch as torch_compat
from trainstack.config import config_from_dict
from trainstack.planner.choose import layout_of
from trainstack.planner.memory import model_state_bytes
from trainstack.planner.workload import workload_from_spec
from trainstack.runtime.capacity import model_state
from trainstack.runtime.gloo_processes import run_processes

from bounds import (
    FP64_BOUND,
    assert_trained,
    float32_sensitivity,
    max_difference,
    sensitivity_bound,
)
from user_model_specs import MODELS

STEPS = 10
LAYOUTS = {  # name: (workers, strategy)
    "ddp1": (1, {"kind": "ddp"}),
    "fsdp2": (2, {"kind": "fsdp"}),
    "fsdp4": (4, {"kind": "fsdp"}),
    "fsdp2-offload": (2, {"kind": "fsdp", "offload_param": "cpu"}),  # FSDP2's CPU offload
    "tp2": (2, {"kind": "fsdp", "tensor_parallel": 2}),
    "tp2xdp2": (4, {"kind": "fsdp", "tensor_parallel": 2}),
    "hsdp2x2": (4, {"kind": "fsdp", "data_parallel_replicate": 2}),
    "zero2": (2, {"kind": "zero", "stage": 2}),
    "pp2xtp2": (4, {"kind": "pipeline", "stages": 2, "tensor_parallel": 2, "microbatches": 2}),
    "pp2xfsdp2": (
        4,
        {
            "kind": "pipeline",
            "stages": 2,
            "data_parallel": 2,
            "shard_replicas": True,
            "microbatches": 2,
        },
    ),
    **{
        f"pp2xfsdp2-{schedule}": (
            4,
            {
                "kind": "pipeline",
                "stages": 2,
                "data_parallel": 2,
                "shard_replicas": True,
                "schedule": schedule,
                "microbatches": microbatches,
            },
        )
        for schedule, microbatches in (("interleaved", 2), ("dualpipev", 4))
    },
    "pp2xhsdp2x2": (
        8,
        {
            "kind": "pipeline",
            "stages": 2,
            "data_parallel": 4,
            "data_parallel_replicate": 2,
            "shard_replicas": True,
            "microbatches": 2,
        },
    ),
    "pp2xdp2xtp2": (
        8,
        {
            "kind": "pipeline",
            "stages": 2,
            "data_parallel": 2,
            "tensor_parallel": 2,
            "microbatches": 2,
        },
    ),
}


def spec(layout: str, storage: Path, **extra: Any) -> dict[str, Any]:
    workers, strategy = LAYOUTS[layout]
    replicas = workers // strategy.get("tensor_parallel", 1)
    if strategy["kind"] == "pipeline":  # a replica's batch in micro-batches of 16 / (d × m)
        replicas = strategy.get("data_parallel", 1) * strategy["microbatches"] // 2
    return {
        "name": f"mesh-{layout}",
        "model": {"kind": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16},
        "data": {"vocab_size": 16, "order": 1, "eval_samples": 32},
        "train": {
            "steps": STEPS,
            "global_batch_size": 16,
            "micro_batch_size": 8 // replicas,
            # DeepSpeed trains in fp32 (its handoff is held to the reference's sensitivity)
            "precision": "fp32" if strategy["kind"] == "zero" else "fp64",
        },
        "optim": {"lr": 1e-2, "warmup_steps": 2, "grad_clip": 1.0, "weight_decay": 0.1},
        "strategy": strategy,
        "scaling": {"num_workers": workers},
        "log": {"every_steps": 5},
        # Saves at 5 and 10: a save is collectives and files on every rank (a sharded one
        # costs a 4-rank run seconds in 10 steps); the resharding chain saves every step.
        "checkpoint": {"storage_path": str(storage), "every_steps": 5, "keep": STEPS},
        **extra,
    }


def train(
    out: Path, layout: str, *, resume_from: Path | None = None, **extra: Any
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    cfg = config_from_dict(spec(layout, out / "runs", **extra))
    summary = run_processes(
        cfg, world_size=cfg.scaling.num_workers, out_dir=out, resume_from=resume_from
    )
    return torch.load(out / "model.pt", weights_only=True), summary


LLAMA = {  # a Hugging Face Llama with grouped key/value heads, at lr 3e-3
    **MODELS["llama"],
    "optim": {"lr": 3e-3, "warmup_steps": 2, "grad_clip": 1.0, "weight_decay": 0.1},
}


class Runs:
    """Each layout's uninterrupted run, trained once for the module."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.done: dict[str, tuple[dict[str, torch.Tensor], dict[str, Any]]] = {}

    def __call__(
        self, layout: str, *, llama: bool = False
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        key = f"{layout}-llama" if llama else layout
        if key not in self.done:
            self.done[key] = train(self.root / key, layout, **(LLAMA if llama else {}))
        return self.done[key]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory.mktemp("runs"))


@pytest.fixture(scope="module")
def reference(runs: Runs) -> dict[str, torch.Tensor]:
    return runs("ddp1")[0]


@pytest.mark.parametrize(
    "layout",
    [
        "fsdp2",
        "fsdp2-offload",
        "tp2",
        "tp2xdp2",
        "hsdp2x2",
        "pp2xtp2",
        "pp2xfsdp2",
        pytest.param("pp2xdp2xtp2", marks=pytest.mark.slow),  # 8 processes on 2 cores
        pytest.param("pp2xhsdp2x2", marks=pytest.mark.slow),
    ],
)
def test_mesh_layout_matches_one_process_after_10_adamw_steps(
    runs: Runs, tmp_path: Path, reference: dict[str, torch.Tensor], layout: str
) -> None:
    weights, summary = runs(layout)
    assert max_difference(weights, reference) < FP64_BOUND
    assert_trained(reference, spec("ddp1", tmp_path))
    assert weights["tok_emb.weight"].dtype == torch.float64
    assert summary["strategy"] == LAYOUTS[layout][1]["kind"]
    assert summary["world_size"] == LAYOUTS[layout][0]


def test_llama_under_tp2_x_fsdp2_matches_one_process(runs: Runs) -> None:
    """Column/row-parallel attention with grouped key/value heads and a SwiGLU MLP, no
    sequence parallelism (rotary embeddings need the whole sequence), sharded by FSDP."""
    reference, _ = runs("ddp1", llama=True)
    weights, _ = runs("tp2xdp2", llama=True)
    assert max_difference(weights, reference) < FP64_BOUND
    assert_trained(reference, spec("ddp1", Path(), **LLAMA))


def test_fsdp_counts_the_bytes_its_collectives_send(tmp_path: Path) -> None:
    """One micro-batch per rank, FSDP over 2: each step all-gathers the fp32 parameters and
    reduce-scatters the fp32 gradients, (n - 1)/n of 4Ψ bytes each from a rank (Ψ
    parameters, each padded to a multiple of n): 4Ψ in all, what a DDP all-reduce sends.
    Resharding after the forward gathers again for the backward: more than that."""
    whole_batch = {"train": {"steps": 3, "global_batch_size": 16, "micro_batch_size": 8}}
    strategy = {"kind": "fsdp", "reshard_after_forward": False}
    _, kept = train(tmp_path / "kept", "fsdp2", **whole_batch, strategy=strategy)
    _, resharded = train(tmp_path / "resharded", "fsdp2", **whole_batch)
    psi = kept["params"]
    assert kept["comm_bytes_per_step"] == pytest.approx(4 * psi, rel=0.01)
    assert resharded["comm_bytes_per_step"] > 1.3 * kept["comm_bytes_per_step"]

    # bf16 is FSDP's mixed-precision policy: parameters gathered in bf16 (2Ψ), gradients
    # reduce-scattered in fp32 (4Ψ), (n - 1)/n of each: 3Ψ; the shards stay fp32.
    bf16 = {"train": {**whole_batch["train"], "precision": "bf16"}}
    _, mixed = train(tmp_path / "bf16", "fsdp2", **bf16, strategy=strategy)
    assert mixed["comm_bytes_per_step"] == pytest.approx(3 * psi, rel=0.01)
    assert mixed["model_state_bytes"]["params"] == pytest.approx(4 * psi / 2, rel=0.02)


def test_fsdp_memory_per_rank_is_the_formulas_share(runs: Runs, tmp_path: Path) -> None:
    """fsdp over 4 ranks: each holds a quarter of the weights, gradients and AdamW's
    moments (float64 here, 8 bytes each), measured from its tensors (FSDP2 pads each
    parameter to a multiple of 4)."""
    _, summary = runs("fsdp4")
    held = summary["model_state_bytes"]
    cfg = config_from_dict(spec("fsdp4", tmp_path))
    formula = model_state(cfg, summary["params"]).per_worker
    measured = held["params"] + held["grads"] + held["optimizer"]
    assert measured == pytest.approx(formula, rel=0.02)
    fp64_weights = 8 * summary["params"]
    assert held["params"] == pytest.approx(fp64_weights / 4, rel=0.02)


FOUR_LAYERS = {"model": {**spec("ddp1", Path())["model"], "n_layer": 4}}
"""Two stages per pipeline rank need four blocks."""


@pytest.fixture(scope="module")
def four_layer_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    return train(tmp_path_factory.mktemp("ddp1-4"), "ddp1", **FOUR_LAYERS)[0]


@pytest.mark.parametrize(
    "layout", ["ddp1", "fsdp2", "fsdp4", "tp2", "tp2xdp2", "hsdp2x2", "pp2xtp2", "pp2xfsdp2"]
)
def test_the_plan_predicts_each_layouts_model_state_within_10_percent(
    runs: Runs, tmp_path: Path, layout: str
) -> None:
    """Rank 0's parameters, gradients and AdamW state, measured from its tensors, against
    what `trainstack plan` and `strategy.kind: auto` assume for the layout."""
    _, summary = runs(layout)
    cfg = config_from_dict(spec(layout, tmp_path))
    layout_plan = layout_of(cfg)
    assert layout_plan is not None
    work = workload_from_spec(cfg)  # float64: 8-byte weights and gradients, 16 of AdamW
    assert (work.weight_bytes, work.optimizer_bytes) == (8, 16)
    planned = model_state_bytes(
        layout_plan,
        params=summary["params"],
        element_bytes=work.element_bytes,
        optimizer_bytes=work.optimizer_bytes,
        weight_bytes=work.weight_bytes,
    ).total
    held = summary["model_state_bytes"]
    measured = held["params"] + held["grads"] + held["optimizer"]
    print(f"{layout}: measured {measured:,} bytes, planned {planned:,} ({measured / planned:.3f})")
    assert measured == pytest.approx(planned, rel=0.10)


@pytest.mark.parametrize("schedule", ["interleaved", "dualpipev"])
def test_multi_stage_schedules_drive_sharded_replicas(
    tmp_path: Path, four_layer_reference: dict[str, torch.Tensor], schedule: str
) -> None:
    """Two stages per rank, placed in a loop (interleaved 1F1B) or as a V whose two
    directions run at once (DualPipeV): torch's schedules unshard, reshard and reduce the
    FSDP stages themselves, and the result is one process's."""
    if schedule == "dualpipev" and not torch_compat.feature("dualpipev").available:
        pytest.skip(f"torch {torch.__version__} has no ScheduleDualPipeV (pre-flight refuses it)")
    weights, _ = train(tmp_path / schedule, f"pp2xfsdp2-{schedule}", **FOUR_LAYERS)
    assert max_difference(weights, four_layer_reference) < FP64_BOUND
    assert_trained(four_layer_reference, spec("ddp1", tmp_path, **FOUR_LAYERS))


@pytest.mark.slow  # 8 processes on 2 cores
def test_pipeline_hsdp_shards_within_a_group_and_replicates_across(runs: Runs) -> None:
    """pp 2 × (2 groups × 2 shards): rank 0 holds half its stage, as under pp 2 × FSDP 2,
    not the quarter that sharding over all four replicas would leave it."""
    hsdp = runs("pp2xhsdp2x2")[1]["model_state_bytes"]
    fsdp2 = runs("pp2xfsdp2")[1]["model_state_bytes"]
    assert hsdp["params"] == fsdp2["params"]
    assert hsdp["optimizer"] == pytest.approx(fsdp2["optimizer"], rel=0.01)


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param("tp2xdp2", marks=pytest.mark.slow),
        pytest.param("pp2xtp2", marks=pytest.mark.slow),
        "pp2xfsdp2",
    ],
)
def test_resume_after_a_killed_worker_is_bitwise_identical(
    runs: Runs, tmp_path: Path, layout: str
) -> None:
    uninterrupted, _ = runs(layout)
    faults = {"kill_at_steps": [6], "rank": 3}
    with pytest.raises(Exception, match="exit code 17"):
        train(tmp_path / "killed", layout, faults=faults)
    resumed, summary = train(tmp_path / "killed", layout, faults=faults)
    assert summary["resumed_from_step"] == 5  # killed in step 6, saved every 5 steps
    for name, weight in uninterrupted.items():
        assert torch.equal(resumed[name], weight), name


@pytest.mark.slow
def test_sharded_checkpoints_reshard_across_layouts_with_their_optimizer_state(
    runs: Runs, tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    """tp2×dp2 → fsdp 4 → ddp 1 → pp2×tp2, each hop resuming the previous run's
    checkpoint at a later step (5, 7, 8), and fsdp 4 → pp2 × fsdp 2 (at 6) beside it (a sharded
    checkpoint into a pipeline's sharded replicas). Adam's moments must come through
    each hop: restarted moments would move every weight by about the learning rate
    (1e-2) at once."""
    chain = [("tp2xdp2", 0), ("fsdp4", 5), ("ddp1", 7), ("pp2xtp2", 8)]
    runs("tp2xdp2")
    previous = runs.root / "tp2xdp2" / "runs" / "mesh-tp2xdp2"
    hops = [(layout, start, None) for layout, start in chain[1:]]
    hops.insert(2, ("pp2xfsdp2", 6, "fsdp4"))  # a branch off the chain's fsdp 4 run
    done: dict[str, Path] = {}
    for layout, start, source in hops:
        out = tmp_path / layout
        resume_from = (done[source] if source else previous) / ckpt.dir_name(start)
        every_step = {"storage_path": str(out / "runs"), "every_steps": 1, "keep": STEPS}
        weights, summary = train(out, layout, resume_from=resume_from, checkpoint=every_step)
        assert summary["resumed_from_step"] == start, layout
        notes = _start_notes(out)
        assert not any("re-initialised" in note for note in notes), (layout, notes)
        assert max_difference(weights, reference) < FP64_BOUND, layout
        done[layout] = out / "runs" / f"mesh-{layout}"
        if source is None:
            previous = done[layout]


@pytest.mark.slow
def test_a_zero_checkpoint_hands_tp2_its_weights_and_adam_state(tmp_path: Path) -> None:
    """DeepSpeed ZeRO-2's consolidated weights and its per-rank optimizer partitions,
    put back together by parameter name, resume under tensor parallelism as if the run
    had never changed layout. Both train in float32 (DeepSpeed has no float64), so the
    bound is the reference's own float32 sensitivity; Adam's moments lost at the handoff
    would move the weights by about the learning rate (1e-2)."""
    fp32 = {"train": {**spec("zero2", tmp_path)["train"]}}
    train(tmp_path / "zero", "zero2", **fp32)
    start = tmp_path / "zero" / "runs" / "mesh-zero2" / ckpt.dir_name(5)
    weights, summary = train(tmp_path / "tp2", "tp2", resume_from=start, **fp32)
    assert summary["resumed_from_step"] == 5
    notes = _start_notes(tmp_path / "tp2")
    assert not any("re-initialised" in note for note in notes), notes
    one, sensitivity = float32_sensitivity(spec("ddp1", tmp_path, **fp32), tmp_path / "ddp")
    bound = sensitivity_bound(sensitivity)
    diff = max_difference(weights, one)
    print(f"zero2 -> tp2: {diff:.3g} from one process (bound {bound:.3g})")
    assert diff < bound


def _start_notes(out: Path) -> list[str]:
    for line in (out / "events.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("event") == "start":
            notes: list[str] = record["notes"]
            return notes
    raise AssertionError("no start event")
