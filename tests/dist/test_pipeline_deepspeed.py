"""`strategy.engine: deepspeed` (DeepSpeed's PipelineEngine) over gloo processes: trains
what one process trains (float32 only: held to the reference's own float32 sensitivity,
`tests/bounds.py`), reports its layout, resumes exactly after a killed worker, and
shares checkpoints with the torch engine and DDP."""

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

from trainstack import checkpoint as ckpt
from trainstack.config import config_from_dict
from trainstack.models import build_model
from trainstack.runtime.gloo_processes import run_processes
from trainstack.strategies.pipeline_deepspeed import (
    TiedWeight,
    deepspeed_layers,
    pipeline_deepspeed_config,
)
from trainstack.strategies.pipeline_split import (
    StageModule,
    model_layers,
    split_stages,
    tied_parameters,
)

from bounds import assert_trained, max_difference, sensitivity_bound

STEPS = 10
MICROBATCHES = 4


def spec(
    storage: Path,
    *,
    kind: str = "pipeline",
    engine: str = "deepspeed",
    stages: int = 2,
    data_parallel: int = 1,
    micro: int | None = None,
    zero_stage: int = 0,
    kill: int | None = None,
    checkpointing: bool = False,
) -> dict[str, Any]:
    """The acceptance setup: GPT 4 × 32, global batch 16, AdamW 1e-2, warmup 2, clip 1.0."""
    pipeline = kind == "pipeline"
    raw: dict[str, Any] = {
        "name": "dspipe",
        "model": {
            "kind": "gpt",
            "n_layer": 4,
            "n_head": 2,
            "n_embd": 32,
            "block_size": 16,
            "activation_checkpointing": checkpointing,
        },
        "data": {"vocab_size": 16, "order": 1, "eval_samples": 32},
        "train": {
            "steps": STEPS,
            "global_batch_size": 16,
            "micro_batch_size": micro or 16 // (data_parallel * MICROBATCHES),
        },
        "optim": {"lr": 1e-2, "warmup_steps": 2, "grad_clip": 1.0, "weight_decay": 0.1},
        "strategy": {"kind": kind},
        "scaling": {"num_workers": stages * data_parallel if pipeline else 1},
        "checkpoint": {"every_steps": 5, "keep": 10, "storage_path": str(storage)},
        "log": {"every_steps": 1},
        "faults": {"kill_at_steps": [kill], "rank": 1} if kill else {},
    }
    if pipeline:
        raw["strategy"].update(
            engine=engine,
            stages=stages,
            data_parallel=data_parallel,
            microbatches=MICROBATCHES,
            schedule="1f1b",
        )
    if zero_stage:
        raw["deepspeed"] = {"zero_optimization": {"stage": zero_stage}}
    return raw


def records(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]


def logged(out: Path, key: str) -> dict[int, float]:
    """`key` per step; a replayed step keeps its latest value."""
    return {r["step"]: r[key] for r in records(out) if "event" not in r}


def notes(out: Path) -> list[str]:
    return [note for r in records(out) if r.get("event") == "start" for note in r["notes"]]


def weights(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "model.pt", weights_only=True)


class Run:
    """One training run in its own directory: `out` holds model.pt and the events."""

    def __init__(self, raw: dict[str, Any], root: Path, *, resume_from: Path | None = None) -> None:
        self.raw, self.out = raw, root / "out"
        cfg = config_from_dict(raw)
        self.run_dir = ckpt.run_dir_for(cfg)
        workers = cfg.scaling.num_workers
        self.summary = run_processes(
            cfg, world_size=workers, out_dir=self.out, resume_from=resume_from
        )
        self.weights = weights(self.out)


LAYOUTS = {
    "2x1": {"stages": 2, "data_parallel": 1},
    "2x2": {"stages": 2, "data_parallel": 2},
    "4x1": {"stages": 4, "data_parallel": 1},
    "2x2-zero1": {"stages": 2, "data_parallel": 2, "zero_stage": 1},
    "2x1-checkpointed": {"stages": 2, "data_parallel": 1, "checkpointing": True},
}


class Runs:
    """Runs trained on first use and shared by the module's tests."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._done: dict[str, Run] = {}

    def get(self, key: str) -> Run:
        if key not in self._done:
            root = self.root / key
            if key.startswith("ddp-micro"):  # one process, the same micro-batches
                raw = spec(root, kind="ddp", micro=int(key.removeprefix("ddp-micro")))
            else:
                raw = spec(root, **LAYOUTS[key])
            self._done[key] = Run(raw, root)
        return self._done[key]

    def reference_for(self, key: str) -> Run:
        """DDP on one process with the pipeline's micro-batch size, so that gradients
        accumulate over the same micro-batches in the same order."""
        micro = 16 // (LAYOUTS[key]["data_parallel"] * MICROBATCHES)
        return self.get(f"ddp-micro{micro}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory.mktemp("dspipe"))


def test_config_derives_the_pipeline_keys_and_merges_raw_deepspeed_keys_last(
    tmp_path: Path,
) -> None:
    raw = spec(tmp_path, data_parallel=2, zero_stage=1)
    raw["deepspeed"]["steps_per_print"] = 1000
    config = pipeline_deepspeed_config(config_from_dict(raw))
    assert config["train_micro_batch_size_per_gpu"] == 2  # 16 / (2 replicas × 4)
    assert config["gradient_accumulation_steps"] == MICROBATCHES
    assert config["gradient_clipping"] == 1.0
    assert config["zero_optimization"] == {"stage": 1}
    assert config["steps_per_print"] == 1000
    assert "optimizer" not in config and "scheduler" not in config  # trainstack's, passed in


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_layers_are_cut_where_the_torch_engine_cuts(stages: int) -> None:
    cfg = config_from_dict(spec(Path("unused"), stages=stages))
    model = build_model(cfg.model, vocab_size=cfg.data.vocab_size, seed=0)
    layers = model_layers(model)
    split = split_stages(layers, stages)
    ties = tied_parameters(model, layers, split)
    assert [(t.name, t.stages) for t in ties] == [("tok_emb.weight", (0, stages - 1))]
    for s in range(stages):
        stage = StageModule(model, layers, split.layers[s])
        specs, parts = deepspeed_layers(stage, stage_index=s, split=split, ties=ties)
        # Stage s is its StageModule, then the tie's spec on the first and the last stage.
        assert parts == [0, 2, *(2 + i for i in range(1, stages - 1)), stages + 2]
        assert specs[parts[s]] is stage
        tied = specs[parts[s] + 1 : parts[s + 1]]
        assert len(tied) == (s in (0, stages - 1))
        for spec_ in tied:
            copy = spec_.build()
            assert isinstance(copy, TiedWeight)
            name = "tok_emb.weight" if s == 0 else "lm_head.weight"
            assert copy.weight is dict(stage.state_dict(keep_vars=True))[name]
    # DeepSpeed numbers ranks as trainstack does: global rank = pp_rank × d + dp_rank.
    topology = PipeDataParallelTopology(num_pp=stages, num_dp=2)
    assert [topology.get_rank(pipe=i, data=j) for i in range(stages) for j in range(2)] == list(
        range(2 * stages)
    )


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_deepspeed_pipeline_matches_one_process_after_10_steps(runs: Runs, layout: str) -> None:
    reference, pipeline = runs.reference_for(layout), runs.get(layout)
    # The reference's own float32 sensitivity: the same run with its micro-batches split
    # in two and (where they divide) in four.
    micro = reference.raw["train"]["micro_batch_size"]
    sensitivity = max(
        max_difference(runs.get(f"ddp-micro{micro // parts}").weights, reference.weights)
        for parts in (2, 4)
        if micro % parts == 0
    )
    bound = sensitivity_bound(sensitivity)
    diff = max_difference(pipeline.weights, reference.weights)
    print(f"{layout}: max |deepspeed pipeline - one process| = {diff:.3g} (bound {bound:.3g})")
    assert sensitivity > 0 and diff < bound
    assert_trained(reference.weights, reference.raw)
    # The clipped norm is the whole model's, the tied weight counted once, on every step
    # (stage 0's alone would be ~20% short, the tied weight twice ~10% over). Steps late
    # in a 2-replica run differ by up to 4e-4 relative: the weights' last-bit differences.
    expected, got = logged(reference.out, "grad_norm"), logged(pipeline.out, "grad_norm")
    assert got.keys() == expected.keys()
    assert all(abs(got[s] - expected[s]) <= 1e-3 * expected[s] for s in expected)
    assert logged(pipeline.out, "lr") == logged(reference.out, "lr")
    assert abs(pipeline.summary["eval_loss"] - reference.summary["eval_loss"]) < 1e-4


def test_run_metrics_report_the_split_and_each_stage(runs: Runs) -> None:
    run = runs.get("2x1")
    cfg = config_from_dict(run.raw)
    model = build_model(cfg.model, vocab_size=cfg.data.vocab_size, seed=cfg.train.seed)
    split = split_stages(model_layers(model), 2)
    metrics = run.summary["pipeline"]
    assert metrics["split"] == split.describe()
    assert metrics["params_per_stage"] == list(split.params)
    assert 0.0 < metrics["bubble_fraction"] < 1.0
    assert all(peak > 0 for peak in metrics["activation_peak_bytes_per_stage"])
    state = run.summary["model_state_bytes"]  # rank 0: stage 0, fp32, Adam's two moments
    assert state["params"] == 4 * split.params[0]
    assert state["grads"] == 4 * split.params[0]
    assert 8 * split.params[0] <= state["optimizer"] <= 8 * split.params[0] + 4096
    final = ckpt.verify(run.run_dir / ckpt.dir_name(STEPS))
    assert set(final.manifest["files"]) == {
        "model/stage_00000.pt",
        "model/stage_00001.pt",
        "optimizer/rank_00000.pt",
        "optimizer/rank_00001.pt",
        "scheduler.pt",
        "rng/rank_00000.pt",
        "rng/rank_00001.pt",
    }


def test_activation_checkpointing_from_the_model_keeps_less_in_deepspeeds_stages(
    runs: Runs,
) -> None:
    """`build_model` checkpoints the GPT's blocks; the stages DeepSpeed runs keep that."""
    plain = runs.get("2x1").summary["pipeline"]["activation_peak_bytes_per_stage"]
    checkpointed = runs.get("2x1-checkpointed").summary["pipeline"]
    peaks = checkpointed["activation_peak_bytes_per_stage"]
    assert all(on < off / 3 for on, off in zip(peaks, plain, strict=True)), (peaks, plain)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["2x2-zero1"])  # ZeRO-1 shards too: the harder one
def test_resume_after_a_killed_worker_is_bitwise_identical(
    runs: Runs, tmp_path: Path, layout: str
) -> None:
    raw = spec(tmp_path, kill=6, **LAYOUTS[layout])
    cfg = config_from_dict(raw)
    with pytest.raises(Exception, match="exit code 17"):
        run_processes(cfg, world_size=4, out_dir=tmp_path / "out")
    run_processes(cfg, world_size=4, out_dir=tmp_path / "out")  # the rerun resumes at 5

    starts = [
        r["resumed_from_step"] for r in records(tmp_path / "out") if r.get("event") == "start"
    ]
    assert starts == [0, 5]
    assert not any("re-initialised" in note for note in notes(tmp_path / "out"))
    uninterrupted = runs.get(layout)
    resumed = logged(tmp_path / "out", "loss")
    assert sorted(resumed) == list(range(1, STEPS + 1))
    assert resumed == logged(uninterrupted.out, "loss")  # every step's loss, exactly
    final = weights(tmp_path / "out")
    for name, value in uninterrupted.weights.items():
        assert torch.equal(final[name], value), name


def test_deepspeed_checkpoint_loads_into_the_torch_engine_ddp_and_a_gpt(
    runs: Runs, tmp_path: Path
) -> None:
    """Resumed at its last step, a run saves what it loaded: the weights must come back."""
    source = runs.get("2x1")
    torch_engine = Run(
        spec(tmp_path / "torch", engine="torch"), tmp_path / "torch", resume_from=source.run_dir
    )
    ddp = Run(
        spec(tmp_path / "ddp", kind="ddp", micro=4), tmp_path / "ddp", resume_from=source.run_dir
    )
    for run in (torch_engine, ddp):
        assert any("optimizer state re-initialised" in note for note in notes(run.out))
        assert run.weights.keys() == source.weights.keys()
        for name, value in source.weights.items():
            assert torch.equal(run.weights[name], value), name
    cfg = config_from_dict(source.raw)
    model = build_model(cfg.model, vocab_size=cfg.data.vocab_size, seed=cfg.train.seed)
    full = ckpt.verify(source.run_dir / ckpt.dir_name(STEPS)).full_weights()
    model.load_state_dict(full)  # strict: every name of the GPT, no other
    assert torch.equal(full["tok_emb.weight"], full["lm_head.weight"])  # the tie held


def test_deepspeed_pipeline_loads_a_ddp_checkpoint(runs: Runs, tmp_path: Path) -> None:
    source = runs.get("ddp-micro4")
    run = Run(spec(tmp_path, stages=4), tmp_path, resume_from=source.run_dir)
    assert any(
        "optimizer state re-initialised (the checkpoint is from ddp)" in n for n in notes(run.out)
    )
    for name, value in source.weights.items():
        assert torch.equal(run.weights[name], value), name
