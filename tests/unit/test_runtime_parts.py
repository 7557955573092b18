"""The loop's parts that need no processes: LR schedule, metrics, progress, kill plans and
their once-per-run markers."""

import io
import itertools
import json
from pathlib import Path

import pytest
import torch

from trainstack.config import config_from_dict
from trainstack.faults import first_firing, kill_plan
from trainstack.observe.throughput import PEAK_FLOPS, ThroughputMeter, device_peak_flops, mfu
from trainstack.optim import build_optimizer, lr_multiplier, scaled_lr
from trainstack.runtime.progress import ProgressDisplay, format_summary


def test_warmup_then_cosine_reaches_the_floor_at_the_last_step() -> None:
    cfg = config_from_dict({"optim": {"warmup_steps": 4, "min_lr_ratio": 0.1}}).optim
    values = [lr_multiplier(s, cfg, total_steps=104) for s in range(104)]
    assert values[:4] == [0.25, 0.5, 0.75, 1.0]
    assert values[4] == 1.0
    assert values[54] == pytest.approx(0.55)  # half-way down the cosine
    assert all(a >= b for a, b in itertools.pairwise(values[4:]))
    assert lr_multiplier(104, cfg, total_steps=104) == pytest.approx(0.1)


def test_lr_scaling_with_world_size() -> None:
    for kind, expected in (("none", 1e-3), ("linear", 4e-3), ("sqrt", 2e-3)):
        cfg = config_from_dict({"optim": {"lr": 1e-3, "lr_scaling": kind}}).optim
        assert scaled_lr(cfg, data_parallel_size=4) == pytest.approx(expected)


def test_weight_decay_skips_biases_and_norms() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    cfg = config_from_dict({"optim": {"weight_decay": 0.1}}).optim
    decayed, plain = build_optimizer(model, cfg, lr=1e-3).param_groups
    assert [p.shape for p in decayed["params"]] == [torch.Size([4, 4])]
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert len(plain["params"]) == 3


def test_throughput_excludes_warmup_steps() -> None:
    meter = ThroughputMeter(tokens_per_step=1000, samples_per_step=10, warmup_steps=2)
    for t in (5.0, 3.0, 0.5, 0.5, 0.5):
        meter.record(t)
    steady = meter.steady_state()
    assert steady["tokens_per_s"] == pytest.approx(2000)
    assert steady["samples_per_s"] == pytest.approx(20)
    assert meter.window()["step_time_s"] == pytest.approx(9.5 / 5)
    meter.record(1.0)
    assert meter.window()["step_time_s"] == pytest.approx(1.0)


def test_mfu_is_none_on_cpu_and_a_fraction_on_known_gpus() -> None:
    assert device_peak_flops(torch.device("cpu")) is None
    assert mfu(flops_per_token=6e9, tokens_per_s=1e4, peak_flops=None, world_size=1) is None
    h100 = PEAK_FLOPS["H100 SXM"]
    assert h100 == 989e12
    value = mfu(flops_per_token=6e9, tokens_per_s=1e4, peak_flops=h100, world_size=2)
    assert value == pytest.approx(6e13 / (2 * 989e12))


def record(step: int, **extra: object) -> dict:
    return {
        "step": step,
        "steps": 100,
        "loss": 2.5,
        "tokens_per_s": 12345.0,
        "mfu": None,
        "elapsed_s": 10.0,
        **extra,
    }


def test_progress_modes() -> None:
    lines = io.StringIO()
    ProgressDisplay(mode="lines", stream=lines).update(record(10))
    assert lines.getvalue() == "step 10/100  loss 2.5000  tok/s 12.3k  MFU -  ETA 0:01:30\n"
    with_eval = io.StringIO()  # log.eval_every_steps: the held-out loss on its steps
    ProgressDisplay(mode="lines", stream=with_eval).update(record(20, eval_loss=2.75))
    assert with_eval.getvalue().endswith("ETA 0:00:40  held-out 2.7500\n")

    bar = io.StringIO()
    display = ProgressDisplay(mode="bar", stream=bar)
    display.update(record(50, restarts=1))
    display.close()
    assert bar.getvalue().startswith("\r[############............] step 50/100")
    assert "restarts 1" in bar.getvalue() and bar.getvalue().endswith("\n")

    jsonl = io.StringIO()
    ProgressDisplay(mode="jsonl", stream=jsonl).update(record(10))
    assert json.loads(jsonl.getvalue())["step"] == 10

    quiet = io.StringIO()
    ProgressDisplay(mode="quiet", stream=quiet).update(record(10))
    assert quiet.getvalue() == ""
    assert ProgressDisplay(mode="auto", stream=io.StringIO()).mode == "lines"  # not a TTY


def test_summary_prints_loss_against_the_floor() -> None:
    text = format_summary(
        {
            "strategy": "ddp",
            "world_size": 2,
            "device": "cpu",
            "steps": 100,
            "final_loss": 2.2,
            "eval_loss": 2.2,
            "entropy_floor": 2.0,
            "tokens_per_s": 1e5,
            "samples_per_s": 1e3,
            "mfu": None,
            "peak_mem_bytes": 2**29,
            "wall_s": 30.0,
            "train_s": 20.0,
            "restarts": 2,
            "recovery": [{"steps_lost": 3}, {"steps_lost": 1}],
            "startup": {
                "checks_s": 0.9,
                "ray_connect_s": 3.1,
                "worker_group_start_s": 5.0,
                "model_build_s": 2.1,
                "first_step_s": 3.1,
                "to_first_step_s": 14.2,
            },
        }
    )
    assert "2.2000 (held-out)" in text and "+10.0% above" in text
    assert "512 MiB per worker" in text and "steps lost per restart: 3, 1" in text
    assert (
        "start-up       14.2 s to the first step (checks 0.9, Ray 3.1, worker group 5.0, " in text
    )


def test_kill_plan_is_seeded_in_range_and_honours_explicit_steps() -> None:
    raw = {
        "train": {"steps": 50},
        "scaling": {"num_workers": 4},
        "faults": {"kill_at_steps": [7], "random_kills": 3, "seed": 11},
    }
    plan = kill_plan(config_from_dict(raw))
    assert plan == kill_plan(config_from_dict(raw))  # same seed, same plan
    assert 7 in plan and len(plan) == 4
    assert all(2 <= step <= 50 or step == 7 for step in plan)
    assert all(0 <= rank < 4 for rank in plan.values())
    raw["faults"]["seed"] = 12
    assert kill_plan(config_from_dict(raw)) != plan


def test_a_planned_kill_fires_once_per_run_however_often_it_is_replayed(tmp_path: Path) -> None:
    marker = tmp_path / "faults" / "killed_before_step_3"  # its folder made on first use
    assert first_firing(marker)
    assert not first_firing(marker)  # the replay after the restart
    assert not first_firing(marker)
    assert first_firing(tmp_path / "faults" / "killed_before_step_4")
