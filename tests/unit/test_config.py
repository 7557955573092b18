"""The job spec: YAML loading, `--set` overrides, coercion and one-line errors."""

from __future__ import annotations

import dataclasses
import textwrap
import typing
from pathlib import Path

import pytest
import yaml

from trainstack.config import (
    ConfigError,
    JobConfig,
    ModelConfig,
    OptimConfig,
    TrainConfig,
    apply_overrides,
    config_from_dict,
    config_to_dict,
    load_config,
    validate,
)

FULL_SPEC = """\
name: full-spec.v1
model: {kind: mlp, n_layer: 3, n_head: 4, n_embd: 96, block_size: 128, dropout: 0.1, context: 8}
data: {kind: markov, vocab_size: 128, order: 2, concentration: 0.5, seed: 7, eval_samples: 0}
train: {steps: 50, global_batch_size: 48, micro_batch_size: 4, seed: 3, precision: bf16}
optim:
  kind: sgd
  lr: 1.0e-2
  weight_decay: 0.01
  betas: [0.8, 0.99]
  momentum: 0.5
  warmup_steps: 5
  schedule: linear
  min_lr_ratio: 0.0
  grad_clip: 0.0
  lr_scaling: sqrt
strategy: {kind: ddp, bucket_cap_mb: 10}
scaling: {num_workers: 3, use_gpu: true, cpus_per_worker: 2}
checkpoint: {every_steps: 10, keep: 1, storage_path: /tmp/runs}
failure: {max_failures: -1}
tracking: {backend: mlflow, uri: "sqlite:///x.db", experiment: exp}
log: {every_steps: 5, progress: jsonl}
"""


def write(tmp_path: Path, text: str, name: str = "job.yaml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def error_of(raw: object) -> str:
    with pytest.raises(ConfigError) as info:
        config_from_dict(raw)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_defaults_build_and_validate() -> None:
    cfg = config_from_dict({})
    assert cfg == JobConfig()
    assert config_from_dict(None) == JobConfig()
    validate(JobConfig())


def test_null_section_means_defaults() -> None:
    assert config_from_dict({"model": None, "optim": {"lr": 0.01}}).model == ModelConfig()


def test_full_yaml_file_loads_every_field_and_round_trips(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, FULL_SPEC))
    assert cfg.name == "full-spec.v1"
    assert cfg.model == ModelConfig(
        kind="mlp", n_layer=3, n_head=4, n_embd=96, block_size=128, dropout=0.1, context=8
    )
    assert cfg.train == TrainConfig(
        steps=50, global_batch_size=48, micro_batch_size=4, seed=3, precision="bf16"
    )
    assert cfg.optim.lr == 0.01 and cfg.optim.betas == (0.8, 0.99)
    assert cfg.strategy.bucket_cap_mb == 10.0 and isinstance(cfg.strategy.bucket_cap_mb, float)
    assert cfg.scaling.use_gpu is True and cfg.scaling.cpus_per_worker == 2.0
    assert (cfg.failure.max_failures, cfg.tracking.backend, cfg.log.progress) == (
        -1,
        "mlflow",
        "jsonl",
    )
    dumped = write(tmp_path, yaml.safe_dump(config_to_dict(cfg)), name="dumped.yaml")
    assert load_config(dumped) == cfg


def test_overrides_coerce_values(tmp_path: Path) -> None:
    overrides = [
        "train.steps=5",
        "optim.lr=1e-3",
        "optim.betas=[0.9, 0.99]",
        "scaling.use_gpu=true",
        "tracking.uri=",
        "optim.warmup_steps=0",
    ]
    cfg = load_config(write(tmp_path, "name: x\n"), overrides)
    assert cfg.train.steps == 5
    assert cfg.optim.lr == 0.001 and isinstance(cfg.optim.lr, float)
    assert cfg.optim.betas == (0.9, 0.99)
    assert cfg.scaling.use_gpu is True
    assert cfg.tracking.uri == ""


def test_apply_overrides_creates_mappings_and_leaves_input_alone() -> None:
    raw = {"train": {"steps": 10}, "model": None}
    out = apply_overrides(raw, ["train.seed=3", "model.kind=mlp", "log.progress=bar"])
    assert out == {
        "train": {"steps": 10, "seed": 3},
        "model": {"kind": "mlp"},
        "log": {"progress": "bar"},
    }
    assert raw == {"train": {"steps": 10}, "model": None}


@pytest.mark.parametrize("override", ["foo", "=3", "train.=3", "a..b=1", " =1"])
def test_malformed_override_is_rejected(override: str) -> None:
    with pytest.raises(ConfigError, match=r"^--set .*: expected key\.sub=value$"):
        apply_overrides({}, [override])


def test_override_with_bad_yaml_value_names_the_override() -> None:
    with pytest.raises(ConfigError, match=r"^--set 'optim\.betas=\[0\.9': value is not valid YAML"):
        apply_overrides({}, ["optim.betas=[0.9"])


def test_override_through_a_scalar_is_rejected() -> None:
    with pytest.raises(ConfigError, match="'model' is 3, not a mapping"):
        apply_overrides({"model": 3}, ["model.kind=gpt"])


def test_unknown_key_suggests_nearest() -> None:
    message = error_of({"optim": {"lrr": 0.1}})
    assert message.startswith("unknown key 'optim.lrr'; did you mean 'optim.lr'?")
    assert "allowed: kind, lr, weight_decay" in message
    assert "did you mean 'model'" in error_of({"modle": {}})
    assert "did you mean" not in error_of({"train": {"zzzzzz": 1}})


def test_wrong_type_names_key_value_and_type() -> None:
    assert error_of({"train": {"steps": "abc"}}) == (
        "train.steps: expected an integer, got 'abc' (str)"
    )
    assert error_of({"train": {"steps": True}}).startswith("train.steps: expected an integer")
    assert error_of({"train": {"steps": 2.5}}).startswith("train.steps: expected an integer")
    assert error_of({"optim": {"betas": [0.9]}}).startswith(
        "optim.betas: expected a list of 2 numbers"
    )
    assert error_of({"optim": {"betas": [0.9, "x"]}}).startswith(
        "optim.betas[1]: expected a number"
    )
    assert error_of({"scaling": {"use_gpu": "maybe"}}).startswith(
        "scaling.use_gpu: expected true or false"
    )
    assert error_of({"name": 123}).startswith("name: expected a string, got 123 (int)")


def test_section_that_is_not_a_mapping_is_rejected() -> None:
    assert error_of({"model": 3}).startswith(
        "model: expected a mapping with keys kind, target, args"
    )
    assert error_of([1, 2]).startswith("job spec: expected a mapping")


def test_lenient_scalar_coercion() -> None:
    cfg = config_from_dict(
        {
            "train": {"steps": "4", "global_batch_size": 32.0},
            "optim": {"lr": "1e-3", "warmup_steps": 0, "weight_decay": 1},
            "scaling": {"use_gpu": "Yes", "cpus_per_worker": "2"},
        }
    )
    assert (cfg.train.steps, cfg.train.global_batch_size) == (4, 32)
    assert isinstance(cfg.train.global_batch_size, int)
    assert (cfg.optim.lr, cfg.optim.weight_decay) == (0.001, 1.0)
    assert isinstance(cfg.optim.weight_decay, float)
    assert cfg.scaling.use_gpu is True and cfg.scaling.cpus_per_worker == 2.0
    assert config_from_dict({"scaling": {"use_gpu": "0"}}).scaling.use_gpu is False


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ({"train": {"steps": 0}}, "train.steps=0 is out of range; allowed: >= 1"),
        ({"model": {"dropout": 1.0}}, "model.dropout=1.0 is out of range; allowed: [0, 1)"),
        ({"optim": {"lr": -1}}, "optim.lr=-1.0 is out of range; allowed: > 0"),
        ({"optim": {"lr": "nan"}}, "optim.lr=nan is not a finite number; allowed: > 0"),
        ({"strategy": {"bucket_cap_mb": ".inf"}}, "strategy.bucket_cap_mb: expected a number"),
        ({"strategy": {"bucket_cap_mb": float("inf")}}, "strategy.bucket_cap_mb=inf is not a"),
        ({"optim": {"betas": [0.9, 1.0]}}, "optim.betas[1]=1.0 is out of range; allowed: [0, 1)"),
        ({"data": {"vocab_size": 1}}, "data.vocab_size=1 is out of range; allowed: 2 to 4194304"),
        ({"model": {"block_size": 140000}}, "model.block_size=140000 is out of range"),
        ({"failure": {"max_failures": -2}}, "failure.max_failures=-2 is out of range"),
        ({"name": "my job"}, "name='my job' is not a valid run name"),
        ({"name": "a" * 101}, "name='aaaa"),
        ({"checkpoint": {"storage_path": ""}}, "checkpoint.storage_path='' is empty"),
        (
            {"checkpoint": {"storage_path": "s3://b/runs"}},
            "checkpoint.storage_path='s3://b/runs' is",
        ),
        (
            {"strategy": {"kind": "dpp"}},
            "strategy.kind='dpp' is not one of ddp, zero, fsdp, pipeline, ps, auto; "
            "did you mean 'ddp'?",
        ),
        ({"log": {"progress": "bars"}}, "log.progress='bars' is not one of auto, bar, lines"),
        ({"optim": {"warmup_steps": 200}}, "optim.warmup_steps=200 must be less than train.steps"),
        (
            {"log": {"every_steps": 10, "eval_every_steps": 15}},
            "log.eval_every_steps=15 is out of range; allowed: 0 (only at the end) or a "
            "multiple of log.every_steps=10",
        ),
    ],
)
def test_out_of_range_value_is_rejected(raw: dict[str, object], expected: str) -> None:
    assert error_of(raw).startswith(expected)


def test_batch_divisibility_message_shows_the_arithmetic() -> None:
    message = error_of({"train": {"global_batch_size": 30, "micro_batch_size": 8}})
    assert message == (
        "train.global_batch_size=30 is not divisible by train.micro_batch_size × "
        "scaling.num_workers = 8 × 2 = 16; allowed: a multiple of 16, e.g. 32"
    )


def test_cross_field_model_and_data_rules() -> None:
    assert error_of({"model": {"n_embd": 65}}).startswith(
        "model.n_embd=65 must be divisible by model.n_head=2"
    )
    assert config_from_dict({"model": {"kind": "mlp", "n_embd": 65}}).model.n_embd == 65
    message = error_of({"data": {"vocab_size": 2048, "order": 2}})
    assert "4194304 Markov states" in message and "1048576" in message


def test_bad_yaml_file_names_path_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, "train:\n  steps: [1\nmodel: {}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"cannot parse job spec {path!r}: line ")
    assert "\n" not in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    path = str(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match=r"^cannot read job spec .*nope\.yaml': no such file$"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"is a directory$"):
        load_config(str(tmp_path))


def test_non_mapping_top_level(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="top level must be a mapping of sections"):
        load_config(write(tmp_path, "- train\n- model\n"))
    assert load_config(write(tmp_path, "", name="empty.yaml")) == JobConfig()


def test_dict_round_trip_is_exact() -> None:
    cfg = dataclasses.replace(
        JobConfig(name="rt"),
        optim=OptimConfig(lr=0.02, betas=(0.5, 0.75), warmup_steps=0, schedule="constant"),
        train=TrainConfig(steps=3, global_batch_size=64, micro_batch_size=16),
    )
    raw = config_to_dict(cfg)
    assert raw["optim"]["betas"] == [0.5, 0.75]
    assert config_from_dict(raw) == cfg
    assert config_to_dict(config_from_dict(raw)) == raw


def test_grad_accum_steps() -> None:
    cfg = config_from_dict(
        {"train": {"global_batch_size": 96, "micro_batch_size": 4}, "scaling": {"num_workers": 3}}
    )
    assert cfg.grad_accum_steps == 8
    assert JobConfig().grad_accum_steps == 2


# ---- compression ------------------------------------------------------------------


def test_compression_section_defaults_off_and_loads_every_field() -> None:
    from trainstack.config import CompressionConfig

    assert JobConfig().compression == CompressionConfig(kind="none")
    spec = {
        "compression": {
            "kind": "qsgd",
            "ratio": "0.1",
            "bits": 4,
            "rank": 2,
            "error_feedback": "no",
            "min_numel": 0,
        }
    }
    cfg = config_from_dict(spec)
    assert cfg.compression == CompressionConfig(
        kind="qsgd", ratio=0.1, bits=4, rank=2, error_feedback=False, min_numel=0
    )
    assert config_from_dict(config_to_dict(cfg)) == cfg
    raw = apply_overrides({}, ["compression.kind=topk", "compression.ratio=1"])
    assert config_from_dict(raw).compression.ratio == 1.0


@pytest.mark.parametrize(
    ("section", "expected"),
    [
        ({"kind": "topc"}, "compression.kind='topc' is not one of none, fp16, bf16, topk, "),
        ({"ratio": 0}, "compression.ratio=0.0 is out of range; allowed: (0, 1]"),
        ({"ratio": 1.5}, "compression.ratio=1.5 is out of range; allowed: (0, 1]"),
        ({"ratio": -0.1}, "compression.ratio=-0.1 is out of range; allowed: (0, 1]"),
        ({"ratio": ".nan"}, "compression.ratio"),
        ({"bits": 3}, "compression.bits=3 is out of range; allowed: 2, 4, 8"),
        ({"bits": 16}, "compression.bits=16 is out of range; allowed: 2, 4, 8"),
        ({"rank": 0}, "compression.rank=0 is out of range; allowed: >= 1"),
        ({"min_numel": -1}, "compression.min_numel=-1 is out of range; allowed: >= 0"),
        ({"kind": "sign", "bitz": 2}, "unknown key 'compression.bitz'; did you mean"),
        ({"kind": "topk", "warmup_steps": -1}, "compression.warmup_steps=-1 is out of range"),
        ({"kind": "topk", "warmup_steps": 200}, "compression.warmup_steps=200 is out of range"),
        ({"kind": "fp16", "warmup_steps": 5}, "compression.warmup_steps applies to lossy"),
        ({"kind": "auto", "auto_link_gbit": -1}, "compression.auto_link_gbit=-1.0 is out of"),
        ({"kind": "topk", "auto_link_gbit": 1}, "compression.auto_link_gbit models the link for"),
    ],
)
def test_compression_out_of_range_values_are_one_line_errors(section: dict, expected: str) -> None:
    assert error_of({"compression": section}).startswith(expected)


def test_compression_needs_ddp_for_now() -> None:
    message = error_of({"compression": {"kind": "topk"}, "strategy": {"kind": "zero"}})
    assert message == "compression.kind=topk needs strategy.kind=ddp or ps; got zero"
    assert config_from_dict({"strategy": {"kind": "zero"}}).compression.kind == "none"
    assert config_from_dict({"compression": {"kind": "powersgd"}}).compression.rank == 4


def test_compression_parts_only_a_ddp_hook_has_are_refused_elsewhere() -> None:
    ps, optim = {"kind": "ps"}, {"grad_clip": 0.0}
    assert error_of({"compression": {"kind": "auto"}, "strategy": ps, "optim": optim}).startswith(
        "compression.kind=auto adapts a DDP hook to the network; strategy.kind is ps"
    )
    local_clip = {"kind": "topk", "local_clip": True}
    message = error_of({"compression": local_clip, "strategy": ps, "optim": optim})
    assert message.startswith("compression.local_clip is a DDP hook's; strategy.kind=ps")
    # on by default, so accepted where it does not apply (ps pushes send gradients)
    topk = {"compression": {"kind": "topk"}, "strategy": ps, "optim": optim}
    assert config_from_dict(topk).compression.momentum_correction


# ---- strategy: ZeRO and raw DeepSpeed keys -----------------------------------------


@pytest.mark.parametrize(
    ("strategy", "expected"),
    [
        ({"stage": 0}, "strategy.stage=0 is out of range; allowed: 1, 2 or 3"),
        ({"stage": 4}, "strategy.stage=4 is out of range; allowed: 1, 2 or 3"),
        (
            {"offload_optimizer": "gpu"},
            "strategy.offload_optimizer='gpu' is not one of none, cpu",
        ),
        ({"offload_param": "nvme", "stage": 3}, "strategy.offload_param='nvme' is not one of"),
        ({"reduce_bucket_size": 0}, "strategy.reduce_bucket_size=0 is out of range; allowed: > 0"),
    ],
)
def test_zero_strategy_values_out_of_range(strategy: dict, expected: str) -> None:
    assert error_of({"strategy": {"kind": "zero", **strategy}}).startswith(expected)


def test_offload_param_needs_stage_3() -> None:
    message = error_of({"strategy": {"kind": "zero", "stage": 2, "offload_param": "cpu"}})
    assert message == (
        "strategy.offload_param=cpu needs strategy.stage=3 (ZeRO-3 shards parameters); got stage 2"
    )
    cfg = config_from_dict({"strategy": {"kind": "zero", "stage": 3, "offload_param": "cpu"}})
    assert cfg.strategy.offload_param == "cpu"
    # a kind that keeps whole parameters on its device takes no parameter offload at all
    for kind in ("ddp", "ps"):
        message = error_of({"strategy": {"kind": kind, "stage": 3, "offload_param": "cpu"}})
        assert message == (
            "strategy.offload_param=cpu is for strategy.kind zero or fsdp; got "
            f"strategy.kind={kind} (leave it at none)"
        )


def test_offload_optimizer_needs_adamw() -> None:
    message = error_of(
        {"strategy": {"kind": "zero", "offload_optimizer": "cpu"}, "optim": {"kind": "sgd"}}
    )
    assert message.startswith("strategy.offload_optimizer=cpu needs optim.kind=adamw")


def test_deepspeed_section_passes_through_valid_keys_under_zero() -> None:
    raw = {
        "strategy": {"kind": "zero", "stage": 3},
        "deepspeed": {
            "zero_optimization": {"stage3_param_persistence_threshold": 0},
            "steps_per_print": 100,
        },
    }
    cfg = config_from_dict(raw)
    assert cfg.deepspeed["zero_optimization"] == {"stage3_param_persistence_threshold": 0}
    assert config_from_dict(config_to_dict(cfg)) == cfg


def test_deepspeed_section_only_with_zero() -> None:
    message = error_of({"deepspeed": {"steps_per_print": 10}})
    assert message == (
        "deepspeed: raw DeepSpeed keys apply only with strategy.kind=zero or "
        "strategy.engine=deepspeed; got strategy.kind=ddp"
    )


def test_unknown_deepspeed_key_names_it_and_the_nearest_valid_one() -> None:
    message = error_of({"strategy": {"kind": "zero"}, "deepspeed": {"steps_per_prnt": 10}})
    assert message == (
        "unknown DeepSpeed key 'deepspeed.steps_per_prnt'; "
        "did you mean 'deepspeed.steps_per_print'?"
    )


@pytest.mark.parametrize(
    ("key", "instead"),
    [
        ("train_micro_batch_size_per_gpu", "train.micro_batch_size"),
        ("gradient_accumulation_steps", "train.global_batch_size"),
        ("train_batch_size", "train.global_batch_size"),
        ("optimizer", "optim.kind"),
        ("scheduler", "optim.schedule"),
        ("gradient_clipping", "optim.grad_clip"),
        ("bf16", "train.precision"),
        ("fp16", "train.precision"),
    ],
)
def test_deepspeed_keys_trainstack_derives_are_refused(key: str, instead: str) -> None:
    message = error_of({"strategy": {"kind": "zero"}, "deepspeed": {key: {}}})
    assert message.startswith(f"deepspeed.{key} is derived from the job spec; set {instead}")


def test_deepspeed_zero_keys_trainstack_derives_are_refused() -> None:
    def zero(section: dict) -> dict:
        return {"strategy": {"kind": "zero"}, "deepspeed": {"zero_optimization": section}}

    assert error_of(zero({"stage": 3})) == (
        "deepspeed.zero_optimization.stage is derived from the job spec; set strategy.stage instead"
    )
    assert error_of(zero({"offload_param": {"device": "cpu"}})) == (
        "deepspeed.zero_optimization.offload_param.device is derived from the job spec; "
        "set strategy.offload_param instead"
    )
    message = error_of(zero({"reduce_bucket_size": 10}))
    assert message.endswith("set strategy.reduce_bucket_size instead")
    pinned = config_from_dict(zero({"offload_optimizer": {"pin_memory": True}}))  # sub-options pass
    assert pinned.deepspeed["zero_optimization"]["offload_optimizer"] == {"pin_memory": True}


@pytest.mark.parametrize(
    ("key", "value"), [("zero_hpz_partition_size", 2), ("zero_quantized_weights", True)]
)
def test_zero3_copies_a_pretrained_read_would_not_fill_are_refused(key: str, value: object) -> None:
    raw = {
        "model": {"kind": "hf", "pretrained": "some/folder"},
        "strategy": {"kind": "zero", "stage": 3},
        "deepspeed": {"zero_optimization": {key: value}},
    }
    assert error_of(raw).startswith(
        f"deepspeed.zero_optimization.{key}={value} with model.pretrained under strategy.stage=3"
    )
    raw["strategy"]["stage"] = 2  # stages 1-2 hold each parameter whole
    assert config_from_dict(raw).deepspeed["zero_optimization"] == {key: value}


# ---- every count has a ceiling -----------------------------------------------------

COUNT_FLOATS = {
    ("strategy", "bucket_cap_mb"),
    ("scaling", "cpus_per_worker"),
    ("scaling", "start_timeout_s"),
    ("faults", "slow_factor"),
}
"""Float fields that count a resource or a repetition; the rest are rates and ratios."""


def count_fields() -> list[tuple[str, str, object]]:
    """(section, key, a value past any ceiling) for every count in the job spec."""
    out: list[tuple[str, str, object]] = []
    for section, cls in typing.get_type_hints(JobConfig).items():
        if not dataclasses.is_dataclass(cls):
            continue
        for key, hint in typing.get_type_hints(cls).items():
            if hint is int:
                out.append((section, key, 10**30))
            elif hint == tuple[int, ...]:
                out.append((section, key, [10**30]))
            elif (section, key) in COUNT_FLOATS:
                out.append((section, key, 1e30))
    return out


@pytest.mark.parametrize(("section", "key", "value"), count_fields())
def test_every_count_in_the_spec_has_a_ceiling(section: str, key: str, value: object) -> None:
    message = error_of({section: {key: value}})
    assert message.startswith(f"{section}.{key}"), message
    assert "out of range" in message or "must be less than" in message, message


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "train: {steps: 1e30}",
            "train.steps=1e+30 is out of range; allowed: at most 1,000,000,000",
        ),
        ("train: {steps: 1.0e+30}", "train.steps=1e+30 is out of range; allowed: at most"),
        ("train: {steps: 1000000001}", "train.steps=1000000001 is out of range; allowed: at most"),
        ("train: {global_batch_size: 1e9}", "train.global_batch_size=1000000000 is out of range"),
        (
            "model: {n_layer: 100000}",
            "model.n_layer=100000 is out of range; allowed: at most 10,000",
        ),
        ("model: {n_embd: 131072}", "model.n_embd=131072 is out of range; allowed: at most 65,536"),
        ("data: {eval_samples: 1e12}", "data.eval_samples=1000000000000 is out of range"),
        ("scaling: {num_workers: 100000}", "scaling.num_workers=100000 is out of range"),
        ("checkpoint: {every_steps: 1e30}", "checkpoint.every_steps=1e+30 is out of range"),
        ("strategy: {kind: ps, num_shards: 1e5}", "strategy.num_shards=100000 is out of range"),
        ("log: {every_steps: 1e10}", "log.every_steps=10000000000 is out of range"),
        ("scaling: {start_timeout_s: -1}", "scaling.start_timeout_s=-1.0 is out of range"),
        ("faults: {kill_shard_at_updates: [0]}", "faults.kill_shard_at_updates[0]=0 is out of"),
    ],
)
def test_counts_past_what_can_run_are_refused(tmp_path: Path, text: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    assert str(info.value).startswith(expected), str(info.value)


def test_counts_at_their_ceiling_build() -> None:
    cfg = config_from_dict(
        {
            "train": {"steps": 10**9},
            "checkpoint": {"every_steps": 10**9, "keep": 10**6},
            "log": {"every_steps": 10**9},
            "scaling": {"start_timeout_s": 0},
        }
    )
    assert cfg.train.steps == 10**9 and cfg.scaling.start_timeout_s == 0


@pytest.mark.parametrize(
    ("strategy", "extra", "words"),
    [
        ({"allreduce": "tree"}, {}, "strategy.allreduce='tree' is not one of flat, hierarchical"),
        ({"kind": "zero", "allreduce": "hierarchical"}, {}, "is for strategy.kind ddp"),
        (
            {"allreduce": "auto"},
            {"compression": {"kind": "auto"}},
            "with compression.kind=auto: the adaptive controller models a flat all-reduce",
        ),
    ],
)
def test_a_node_aware_all_reduce_it_cannot_run_is_refused_in_one_line(
    strategy: dict, extra: dict, words: str
) -> None:
    message = error_of({"strategy": strategy, **extra})
    assert words in message and "\n" not in message, message
