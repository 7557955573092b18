"""The plan at launch: `strategy.kind: auto` resolves to the recommended layout, and a
layout the devices cannot hold is refused before anything starts, with the plan's
figure and the best layout that fits."""

from pathlib import Path
from typing import Any

import pytest

from trainstack.config import ConfigError, config_from_dict, load_config
from trainstack.planner.choose import check_layout_fits, resolve_auto

ROOT = Path(__file__).resolve().parents[2]


def spec(tmp_path: Path, **sections: dict[str, Any]) -> dict[str, Any]:
    """A 6.3M-parameter GPT on two workers: DDP holds 101 MB of weights, gradients and
    AdamW state a rank, sharded layouts about half."""
    raw: dict[str, Any] = {
        "name": "plan",
        "model": {"kind": "gpt", "n_layer": 8, "n_head": 4, "n_embd": 256, "block_size": 32},
        "data": {"vocab_size": 16},
        "train": {"steps": 20, "global_batch_size": 8, "micro_batch_size": 4},
        "scaling": {"num_workers": 2},
        "checkpoint": {"storage_path": str(tmp_path)},
    }
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    return raw


def test_auto_takes_the_simplest_of_equally_fast_layouts_and_says_why(tmp_path: Path) -> None:
    """The demo's model is so small that DDP, ZeRO-1/2 and unresharded FSDP model the
    same step time: the tie goes to DDP."""
    cfg = load_config(
        str(ROOT / "jobs/configs/demo.yaml"),
        ["strategy.kind=auto", "scaling.device_memory=80GB", f"checkpoint.storage_path={tmp_path}"],
    )
    chosen, why = resolve_auto(cfg)
    assert chosen.strategy.kind == "ddp" and chosen.scaling.num_workers == 2
    assert why.startswith("strategy.kind=auto chose ddp 2 (strategy.kind=ddp")
    assert "layouts that fit 80 GB a device" in why and "\n" not in why


def test_auto_shards_what_ddp_cannot_hold(tmp_path: Path) -> None:
    tight = {"device_memory": "1.15GB"}
    cfg = config_from_dict(spec(tmp_path, strategy={"kind": "auto"}, scaling=tight))
    chosen, why = resolve_auto(cfg)
    assert chosen.strategy.kind in ("zero", "fsdp", "pipeline")
    assert "(ddp would need about" in why


def test_auto_with_nothing_that_fits_is_one_line(tmp_path: Path) -> None:
    cfg = config_from_dict(
        spec(tmp_path, strategy={"kind": "auto"}, scaling={"device_memory": "100MB"})
    )
    with pytest.raises(ConfigError, match="no layout fits 100 MB a device; the smallest") as err:
        resolve_auto(cfg)
    assert "\n" not in str(err.value)


def test_a_layout_the_devices_cannot_hold_is_refused_with_the_best_that_fits(
    tmp_path: Path,
) -> None:
    cfg = config_from_dict(spec(tmp_path, scaling={"device_memory": "1.15GB"}))
    with pytest.raises(ConfigError) as err:
        check_layout_fits(cfg)
    message = str(err.value)
    assert message.startswith("ddp 2 needs about ")
    assert "more than the 1.15 GB each worker has here" in message
    assert "the plan's best layout that fits is " in message and "\n" not in message
    roomy = config_from_dict(spec(tmp_path, scaling={"device_memory": "2GB"}))
    check_layout_fits(roomy)  # fits: no error


def test_a_bad_device_memory_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"scaling\.device_memory=80XB: not a quantity"):
        config_from_dict(spec(tmp_path, scaling={"device_memory": "80XB"}))


def test_auto_with_lora_counts_the_adapters_alone_and_keeps_ddp(tmp_path: Path) -> None:
    """Where a full fine-tune must shard (above), LoRA's state is the frozen weights and
    the adapters' own gradients and AdamW state: DDP holds it, and auto takes it."""
    tight = {"device_memory": "1.15GB"}
    lora = {"lora": {"rank": 4}}
    cfg = config_from_dict(spec(tmp_path, strategy={"kind": "auto"}, scaling=tight, model=lora))
    chosen, why = resolve_auto(cfg)
    assert chosen.strategy.kind == "ddp" and chosen.model.lora.rank == 4
    assert why.startswith("strategy.kind=auto chose ddp 2") and "(ddp would need" not in why


def test_a_sequence_one_rank_cannot_hold_is_refused_for_cp1_and_accepted_for_cp2() -> None:
    """The demo's GPT at 16,384 tokens a row on 2 workers with 1.18 GB each: under plain
    fsdp a rank keeps the whole row's activations (about 146 MB beside 1 GiB of framework
    overhead) and pre-flight refuses it (offering what fits: here recomputing the
    activations, which the plan models faster than the ring on its link); with
    `strategy.context_parallel=2` each rank keeps half the row's and it is accepted (the
    meter agrees with these figures: benchmarks/context_parallel.py)."""
    sets = [
        "strategy.kind=fsdp",
        "scaling.num_workers=2",
        "scaling.device_memory=1.18GB",
        "model.block_size=16384",
        "train.global_batch_size=2",
        "train.micro_batch_size=1",
    ]
    whole = load_config(str(ROOT / "jobs/configs/demo.yaml"), sets)
    with pytest.raises(ConfigError) as err:
        check_layout_fits(whole)
    assert str(err.value).startswith("fsdp 2 needs about ")
    assert "more than the 1.18 GB each worker has here" in str(err.value)
    split = load_config(
        str(ROOT / "jobs/configs/demo.yaml"), [*sets, "strategy.context_parallel=2"]
    )
    check_layout_fits(split)
