"""What a job needs of its machine, refused on the driver before Ray starts: more
workers than a local Ray instance holds, a model bigger than memory, unwritable
checkpoint storage."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from trainstack import cli
from trainstack.config import ConfigError, JobConfig, ModelConfig, config_from_dict
from trainstack.errors import show
from trainstack.machine import local_cpus
from trainstack.models import GPT, WindowMLP
from trainstack.runtime.capacity import (
    check_fits_this_machine,
    check_local_resources,
    check_model_fits,
    cluster_wait_note,
    model_state,
    parameter_count,
    start_timeout_message,
)
from trainstack.runtime.preflight import check_storage

GIB = 2**30


@pytest.mark.parametrize("model_cls", [GPT, WindowMLP])
@pytest.mark.parametrize(
    ("n_layer", "n_head", "n_embd", "block_size", "context", "vocab_size"),
    [(1, 1, 8, 16, 1, 10), (3, 4, 64, 128, 4, 300), (2, 3, 96, 32, 8, 7)],
)
def test_builtin_parameter_formulas_match_the_built_models(
    model_cls: Any,
    n_layer: int,
    n_head: int,
    n_embd: int,
    block_size: int,
    context: int,
    vocab_size: int,
) -> None:
    cfg = ModelConfig(
        n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size, context=context
    )
    model = model_cls(cfg, vocab_size=vocab_size)
    built = (sum(p.numel() for p in model.parameters()), len(list(model.parameters())))
    assert model_cls.count_parameters(cfg, vocab_size=vocab_size) == built


def spec(**sections: dict[str, Any]) -> JobConfig:
    """A valid spec: by default a batch of 240 samples, one per micro-batch, which any
    worker count used here divides."""
    return config_from_dict(
        {"train": {"global_batch_size": 240, "micro_batch_size": 1}, **sections}
    )


@pytest.mark.parametrize(
    ("sections", "per_worker", "elsewhere"),
    [
        ({}, 16, 0),  # DDP, AdamW: weights, grads, two moments
        ({"optim": {"kind": "sgd", "momentum": 0.9}}, 12, 0),
        ({"optim": {"kind": "sgd", "momentum": 0.0}}, 8, 0),
        # ZeRO on N = 4 workers, fp32 (docs/zero.md's table): 8 + 12/N, 4 + 16/N, 20/N
        ({"strategy": {"kind": "zero", "stage": 1}}, 8 + 12 / 4, 0),
        ({"strategy": {"kind": "zero", "stage": 2}}, 4 + 16 / 4, 0),
        ({"strategy": {"kind": "zero", "stage": 3}}, 20 / 4, 0),
        # bf16: 4 + 12/N, 2 + 14/N, 16/N
        ({"strategy": {"kind": "zero", "stage": 1}, "train": {"precision": "bf16"}}, 4 + 3, 0),
        ({"strategy": {"kind": "zero", "stage": 2}, "train": {"precision": "bf16"}}, 2 + 3.5, 0),
        ({"strategy": {"kind": "zero", "stage": 3}, "train": {"precision": "bf16"}}, 4, 0),
        # a pipeline of 4 stages holds a quarter of the model per rank
        (
            {
                "strategy": {"kind": "pipeline", "stages": 4},
                "model": {"n_layer": 4},
                "train": {"global_batch_size": 32, "micro_batch_size": 8},
            },
            4,
            0,
        ),
        # the planner's model (planner/memory.py) for every layout: a pipeline's tensor-
        # parallel or sharded replicas split each stage further (16 / (2 stages × 2))
        (
            {
                "strategy": {"kind": "pipeline", "stages": 2, "tensor_parallel": 2},
                "model": {"n_layer": 2},
                "train": {"global_batch_size": 32, "micro_batch_size": 8},
            },
            4,
            0,
        ),
        (
            {
                "strategy": {
                    "kind": "pipeline",
                    "stages": 2,
                    "data_parallel": 2,
                    "shard_replicas": True,
                },
                "model": {"n_layer": 2},
                "train": {"global_batch_size": 32, "micro_batch_size": 4},
            },
            4,
            0,
        ),
        # parameter server: workers hold weights and grads, the shards weights and moments
        ({"strategy": {"kind": "ps"}, "optim": {"grad_clip": 0}}, 8, 12),
    ],
)
def test_model_state_bytes_follow_strategy_and_optimizer(
    sections: dict[str, Any], per_worker: float, elsewhere: int
) -> None:
    cfg = spec(scaling={"num_workers": 4}, **sections)
    params = 1_000_000
    state = model_state(cfg, params)
    assert state.per_worker == per_worker * params
    assert state.elsewhere == elsewhere * params


def test_offloaded_zero_state_is_not_counted_against_the_gpu() -> None:
    cfg = spec(
        scaling={"num_workers": 4, "use_gpu": True},
        strategy={"kind": "zero", "stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"},
    )
    state = model_state(cfg, 1_000_000)
    assert state.per_worker == 20 / 4 * 1_000_000
    assert state.on_device == 4 / 4 * 1_000_000  # the gradient partition stays


def test_a_model_bigger_than_memory_is_refused_with_its_size() -> None:
    cfg = spec(model={"n_layer": 100, "n_embd": 4096, "n_head": 32})
    params = parameter_count(cfg)
    assert params == GPT.count_parameters(cfg.model, vocab_size=64)[0]
    with pytest.raises(ConfigError) as info:
        check_model_fits(cfg, model_state(cfg, params), memory=24 * GIB, where="this machine")
    assert str(info.value) == (
        "model.kind=gpt (n_layer=100, n_embd=4096, vocab 64): about 322 GB of parameters, "
        f"gradients and AdamW state per worker ({params:,} parameters), 644 GB for the 2 "
        "worker(s) together, more than the 25.8 GB this machine has; use a smaller model, "
        "fewer workers, or strategy.kind=zero (sharded state)"
    )
    check_model_fits(cfg, model_state(cfg, params), memory=1024 * GIB, where="this machine")


def test_the_estimate_runs_before_anything_is_built() -> None:
    # 10,000 layers 4096 wide: 2e12 parameters, about 30 TiB; building it would take
    # hours and more memory than any machine has, so only the formula can answer.
    cfg = spec(model={"n_layer": 10_000, "n_embd": 4096, "n_head": 32}, scaling={"num_workers": 1})
    with pytest.raises(ConfigError, match=r"about 3\d\.\d TB of parameters, gradients and AdamW"):
        check_fits_this_machine(cfg)


def test_a_custom_model_is_counted_on_the_meta_device() -> None:
    cfg = spec(
        model={
            "kind": "custom",
            "target": "torch.nn:Linear",
            "args": {"in_features": 3, "out_features": 5},
        },
        task={"kind": "classify"},
        data={"kind": "clusters", "shape": [3], "num_classes": 5},
    )
    assert parameter_count(cfg) == 3 * 5 + 5


@pytest.mark.parametrize(
    ("scaling", "cpus", "gpus", "expected"),
    [
        (
            {"num_workers": 8, "cpus_per_worker": 1},
            2,
            0,
            "scaling.num_workers × scaling.cpus_per_worker = 8 × 1 = 8 CPUs, but the local Ray "
            "instance this run starts has this machine's 2; allowed: num_workers × "
            "cpus_per_worker <= 2 (or run on a cluster with --address)",
        ),
        (
            {"num_workers": 3, "cpus_per_worker": 0.75},
            2,
            0,
            "scaling.num_workers × scaling.cpus_per_worker = 3 × 0.75 = 2.25 CPUs",
        ),
        (
            {"num_workers": 2, "use_gpu": True},
            4,
            1,
            "scaling.num_workers=2 with scaling.use_gpu=true needs 2 GPUs, but this machine has "
            "1 that torch can use",
        ),
    ],
)
def test_more_workers_than_the_local_instance_holds_are_refused(
    scaling: dict[str, Any], cpus: float, gpus: int, expected: str
) -> None:
    with pytest.raises(ConfigError) as info:
        check_local_resources(spec(scaling=scaling), cpus=cpus, gpus=gpus)
    assert str(info.value).startswith(expected)


def test_workers_that_fit_the_local_instance_pass() -> None:
    check_local_resources(spec(scaling={"num_workers": 4, "cpus_per_worker": 0.5}), cpus=2, gpus=0)
    check_local_resources(spec(scaling={"num_workers": 2, "use_gpu": True}), cpus=2, gpus=2)
    ps_on_gpu = spec(scaling={"use_gpu": True}, strategy={"kind": "ps"}, optim={"grad_clip": 0})
    check_local_resources(ps_on_gpu, cpus=2, gpus=2)  # parameter-server workers take one each
    with pytest.raises(ConfigError, match="needs 2 GPUs, but this machine has 0"):
        check_local_resources(ps_on_gpu, cpus=2, gpus=0)


def test_cluster_wait_note_says_what_is_missing() -> None:
    cfg = spec(scaling={"num_workers": 8, "start_timeout_s": 30})
    assert cluster_wait_note(cfg, {"CPU": 8.0}) is None
    assert cluster_wait_note(cfg, {"CPU": 2.0}) == (
        "waiting for room on the cluster (up to scaling.start_timeout_s=30 s): "
        "scaling.num_workers=8 need 8 CPU (2 free)"
    )
    assert start_timeout_message(cfg).startswith(
        "the cluster did not make room for scaling.num_workers=8 (8 CPU) within "
        "scaling.start_timeout_s=30 s"
    )


@pytest.mark.parametrize("storage", ["/proc/x", "/proc/x/runs", "FILE"])
def test_unwritable_checkpoint_storage_is_refused(tmp_path: Path, storage: str) -> None:
    if storage == "FILE":
        storage = str(tmp_path / "a-file")
        Path(storage).write_text("")
    with pytest.raises(ConfigError) as info:
        check_storage(spec(checkpoint={"storage_path": storage}))
    message = str(info.value)
    assert message.startswith(f"checkpoint.storage_path={show(storage)}: cannot write in ")
    assert "\n" not in message


def test_checkpoint_storage_check_leaves_nothing_behind(tmp_path: Path) -> None:
    storage = tmp_path / "new" / "runs"
    check_storage(spec(checkpoint={"storage_path": str(storage)}))
    assert list(tmp_path.iterdir()) == []  # the folders it made to probe are gone again
    (tmp_path / "kept").mkdir()
    check_storage(spec(checkpoint={"storage_path": str(tmp_path / "kept")}))
    assert [p.name for p in tmp_path.iterdir()] == ["kept"] and not list(
        (tmp_path / "kept").iterdir()
    )


def run_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str], *sets: str) -> tuple[int, str]:
    job = tmp_path / "job.yaml"
    job.write_text(f"checkpoint: {{storage_path: {tmp_path / 'runs'}}}\n")
    args = ["run", str(job), "--progress", "quiet"]
    for override in sets:
        args += ["--set", override]
    code = cli.main(args)
    return code, capsys.readouterr().err


def test_cli_refuses_what_the_local_machine_can_never_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], refuse_ray_start: None
) -> None:
    too_many = int(local_cpus()) + 1
    batch = (f"train.global_batch_size={too_many}", "train.micro_batch_size=1")
    cases = {
        f"scaling.num_workers={too_many}": "scaling.num_workers × scaling.cpus_per_worker = ",
        "model.n_layer=5000": "model.kind=gpt (n_layer=5000",
        "checkpoint.storage_path=/proc/x": "checkpoint.storage_path='/proc/x': cannot write",
    }
    for override, expected in cases.items():
        code, err = run_cli(
            tmp_path, capsys, *batch, "scaling.num_workers=1", override, "model.n_embd=2048"
        )
        assert code == 2, err
        assert err.startswith(f"trainstack: error: {expected}"), err
        assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "runs").exists()
    assert os.listdir(tmp_path) == ["job.yaml"]
