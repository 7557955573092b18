"""Speed options' CPU-side behaviour: what is refused with one line, what the optimizer
and the host-to-device copy do without a GPU (the GPU side is in tests/gpu)."""

from pathlib import Path
from typing import Any

import pytest
import torch

from trainstack.config import ConfigError, config_from_dict
from trainstack.models import build_model
from trainstack.optim import build_optimizer
from trainstack.runtime.preflight import preflight
from trainstack.strategies.base import to_device


def spec(tmp_path: Path, **sections: dict[str, Any]) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "name": "speed",
        "model": {"kind": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 8},
        "data": {"vocab_size": 16},
        "train": {"steps": 4, "global_batch_size": 8, "micro_batch_size": 4},
        "optim": {"warmup_steps": 1},
        "checkpoint": {"storage_path": str(tmp_path)},
    }
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    return raw


DEEPSPEED_PIPELINE = {"kind": "pipeline", "engine": "deepspeed", "stages": 2, "microbatches": 2}
PIPELINE_TP = {"kind": "pipeline", "stages": 2, "tensor_parallel": 2, "microbatches": 2}


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        (
            {"strategy": DEEPSPEED_PIPELINE, "train": {"compile": True}},
            "train.compile=true compiles the blocks of the torch engine's stages",
        ),
        (
            {"strategy": DEEPSPEED_PIPELINE, "train": {"precision": "bf16"}},
            "train.precision=bf16 with strategy.engine=deepspeed",
        ),
        (
            {
                "strategy": PIPELINE_TP,
                "scaling": {"num_workers": 4},
                "train": {"compile": True},
                "model": {"activation_checkpointing": True},
            },
            "fails in torch.compile",
        ),
    ],
)
def test_combinations_that_cannot_run_are_refused_with_one_line(
    tmp_path: Path, sections: dict[str, Any], message: str
) -> None:
    raw = spec(tmp_path, **{"scaling": {"num_workers": 2}, **sections})
    with pytest.raises(ConfigError, match=message) as err:
        config_from_dict(raw)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "strategy", [{"kind": "pipeline", "stages": 2, "microbatches": 2}, {"kind": "ps"}]
)
def test_pipelines_and_the_parameter_server_take_bf16(
    tmp_path: Path, strategy: dict[str, Any]
) -> None:
    raw = spec(tmp_path, strategy=strategy, train={"precision": "bf16"}, optim={"grad_clip": 0})
    assert config_from_dict(raw).train.precision == "bf16"


def test_compile_needs_repeated_blocks(tmp_path: Path) -> None:
    raw = spec(tmp_path, model={"kind": "mlp"}, train={"compile": True})
    with pytest.raises(ConfigError, match="WindowMLP has none"):
        preflight(config_from_dict(raw))


def test_the_fused_kernel_is_asked_for_on_a_gpu_only(tmp_path: Path) -> None:
    cfg = config_from_dict(spec(tmp_path))
    assert cfg.optim.fused  # the default
    model = build_model(cfg.model, vocab_size=16, seed=0)
    assert not build_optimizer(model, cfg.optim, lr=1e-3).defaults["fused"]


def test_batches_on_cpu_are_left_unpinned_and_unchanged() -> None:
    x, y = torch.arange(6).view(2, 3), torch.arange(6, 12).view(2, 3)
    moved = to_device((x, y), torch.device("cpu"), pin_memory=True)
    assert torch.equal(moved[0], x) and torch.equal(moved[1], y)
    assert not moved[0].is_pinned()
