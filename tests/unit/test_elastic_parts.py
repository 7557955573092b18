"""Elastic worker counts and placement without Ray: the `{min, max}` spec form and its
checks, how a group of any size keeps the global batch, how long a start attempt waits,
custom worker resources against the local instance, and resizes told apart from
same-size restarts."""

from typing import Any

import pytest

from trainstack.config import ConfigError, config_from_dict, config_to_dict
from trainstack.data import build_corpus
from trainstack.data.sharding import DataCursor, ShardedBatches
from trainstack.observe.tracking import NullTracker
from trainstack.runtime.capacity import (
    ELASTIC_ATTEMPT_S,
    attempt_timeout_s,
    check_local_resources,
    worker_resources,
)
from trainstack.runtime.events import RunFollower
from trainstack.runtime.loop import fit_to_group


def elastic(**scaling: Any) -> dict[str, Any]:
    return {
        "train": {"global_batch_size": 24, "micro_batch_size": 4},
        "scaling": {"num_workers": {"min": 1, "max": 4}, **scaling},
    }


def test_min_max_is_shorthand_for_num_workers_and_min_workers_and_round_trips() -> None:
    cfg = config_from_dict(elastic())
    assert (cfg.scaling.num_workers, cfg.scaling.min_workers, cfg.scaling.elastic) == (4, 1, True)
    assert config_from_dict(config_to_dict(cfg)) == cfg
    fixed = config_from_dict({"scaling": {"num_workers": 2}})
    assert fixed.scaling.min_workers == 0 and not fixed.scaling.elastic


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            {"train": {"global_batch_size": 16, "micro_batch_size": 4}},
            "train.global_batch_size=16 must be divisible by every worker count of "
            "scaling.num_workers={min: 1, max: 4} (the global batch stays fixed as the group "
            "resizes); 3 does not divide it; allowed: a multiple of 12, e.g. 24",
        ),
        (
            {"scaling": {"num_workers": {"min": 5, "max": 4}}},
            "scaling.min_workers=5 is out of range; allowed: 0 (a fixed group) to "
            "scaling.num_workers=4",
        ),
        (
            {"scaling": {"num_workers": {"min": 1}}},
            "scaling.num_workers: expected a number or {min: M, max: N}, got {'min': 1}",
        ),
        (
            {"scaling": {"num_workers": {"min": 1, "max": 4}, "min_workers": 1}},
            "scaling: give the elastic range once",
        ),
        (
            {"strategy": {"kind": "ps"}, "optim": {"grad_clip": 0}},
            "scaling.num_workers={min: 1, max: 4} with strategy.kind=ps: elastic scaling is "
            "for strategy.kind ddp or zero",
        ),
        (
            {"scaling": {"num_workers": {"min": 1, "max": 4}, "resources_per_worker": {"GPU": 1}}},
            "scaling.resources_per_worker.GPU: CPUs and GPUs are set by scaling.cpus_per_worker",
        ),
        (
            {"scaling": {"num_workers": 2, "resources_per_worker": {"trainer": 0}}},
            "scaling.resources_per_worker.trainer=0.0 is out of range; allowed: > 0",
        ),
        (
            {"scaling": {"num_workers": 2, "resources_per_worker": {"trainer": "one"}}},
            "scaling.resources_per_worker.trainer: expected a number, got 'one'",
        ),
        (
            {"scaling": {"num_workers": 2, "resize_check_s": 0}},
            "scaling.resize_check_s=0.0 is out of range; allowed: > 0",
        ),
        ({"faults": {"step_delay_s": -1}}, "faults.step_delay_s=-1.0 is out of range"),
        ({"failure": {"health_check_s": 0}}, "failure.health_check_s=0.0 is out of range"),
        (
            {"faults": {"mid_save": True}, "checkpoint": {"async_save": False}},
            "faults.mid_save=true needs a save in flight; allowed: with checkpoint.async_save",
        ),
    ],
)
def test_bad_elastic_and_placement_specs_get_one_line(raw: dict[str, Any], message: str) -> None:
    base = elastic()
    merged = {key: {**base.get(key, {}), **raw.get(key, {})} for key in base.keys() | raw.keys()}
    with pytest.raises(ConfigError) as err:
        config_from_dict(merged)
    assert str(err.value).startswith(message), str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_group_size_takes_the_same_global_batches(world: int) -> None:
    """The samples a group of `world` workers trains on in a step are the global batch,
    each exactly once, whatever micro-batch the size forces."""
    cfg, note = fit_to_group(config_from_dict(elastic()), world)
    assert cfg.train.global_batch_size == 24 and cfg.scaling.num_workers == world
    assert cfg.train.micro_batch_size <= 4
    assert (24 // world) % cfg.train.micro_batch_size == 0
    assert (note is None) == (world == 4 and cfg.train.micro_batch_size == 4)


def seen_in_step(cfg: Any, world: int, step: int) -> list[list[int]]:
    rows = []
    for rank in range(world):
        batches = ShardedBatches(
            corpus=build_corpus(cfg.data),
            seq_len=cfg.model.block_size,
            global_batch_size=cfg.train.global_batch_size,
            micro_batch_size=cfg.train.micro_batch_size,
            rank=rank,
            world_size=world,
            cursor=DataCursor(samples_seen=step * cfg.train.global_batch_size),
        )
        for x, _ in batches.next_step():
            rows.extend(x.tolist())
    return sorted(rows)


def test_a_resized_group_reads_exactly_the_samples_the_fixed_group_would() -> None:
    base = config_from_dict(elastic())
    expected = seen_in_step(fit_to_group(base, 4)[0], 4, step=7)
    for world in (1, 2, 3):
        assert seen_in_step(fit_to_group(base, world)[0], world, step=7) == expected


def test_a_fixed_group_is_left_as_it_is() -> None:
    cfg = config_from_dict({"scaling": {"num_workers": 2}})
    assert fit_to_group(cfg, 2) == (cfg, None)


def test_start_attempts_of_an_elastic_group_wait_at_most_a_minute() -> None:
    assert attempt_timeout_s(config_from_dict({})) == 600
    assert attempt_timeout_s(config_from_dict(elastic())) == ELASTIC_ATTEMPT_S
    assert attempt_timeout_s(config_from_dict(elastic(start_timeout_s=25))) == 25
    assert attempt_timeout_s(config_from_dict(elastic(start_timeout_s=0))) == ELASTIC_ATTEMPT_S


def test_an_elastic_group_needs_room_for_min_and_custom_resources_need_a_cluster() -> None:
    cfg = config_from_dict(elastic(resources_per_worker={"trainer": 1}))
    assert worker_resources(cfg) == {"CPU": 1.0, "trainer": 1.0}  # min = 1 worker
    with pytest.raises(ConfigError, match="advertises no custom resources"):
        check_local_resources(cfg, cpus=2, gpus=0)
    check_local_resources(config_from_dict(elastic()), cpus=1, gpus=0)  # min fits: fine


def test_resizes_are_told_apart_from_same_size_restarts() -> None:
    follower = RunFollower(display=None, tracker=NullTracker())

    def start(size: int, step: int) -> dict[str, Any]:
        return {"event": "start", "resumed_from_step": step, "world_size": size, "notes": []}

    failure = {"event": "failure", "rank": 0, "error": "node died", "time": 0.0}
    for record in [start(2, 0), {"step": 10}, start(3, 8), {"step": 20}, failure, start(3, 16)]:
        follower.handle(record)
    follower.handle(failure)
    follower.handle(start(1, 16))
    # a shrink whose failure event reaches the queue only after the new group's start
    for record in [{"step": 20}, start(3, 20), {"step": 24}, start(2, 24), failure]:
        follower.handle(record)
    assert follower.resizes == [
        {"step": 8, "from": 2, "to": 3, "reason": "room for more workers"},
        {"step": 16, "from": 3, "to": 1, "reason": "workers lost"},
        {"step": 20, "from": 1, "to": 3, "reason": "room for more workers"},
        {"step": 24, "from": 3, "to": 2, "reason": "workers lost"},
    ]
