"""Parameter-server pieces without Ray: the byte-balanced partition, the flat wire
format, the bounded-staleness rule under random worker speeds, local servers' groups
and staleness bound, and spec checks."""

import asyncio
import math
import random
from typing import Any

import numpy as np
import pytest
import torch

from trainstack.config import ConfigError, ModelConfig, config_from_dict, config_to_dict
from trainstack.models import build_model
from trainstack.models.gpt import GPT
from trainstack.ps.clock import ClockBoard, StalenessBound, bound_for
from trainstack.ps.local import clock_lag_bound, worker_groups
from trainstack.ps.partition import check_shards, partition


def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16), vocab_size=64)


@pytest.mark.parametrize("shards", [1, 2, 3, 5])
def test_partition_covers_every_parameter_once_balanced_by_bytes(shards: int) -> None:
    model = gpt()
    layouts = partition(model, shards)
    names = [n for layout in layouts for n in layout.names]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    sizes = [layout.numel for layout in layouts]
    largest = max(p.numel() for p in model.parameters())
    # Greedy largest-first: no shard exceeds the lightest by more than one tensor.
    assert max(sizes) - min(sizes) <= largest


def test_flat_wire_format_round_trips() -> None:
    model = gpt()
    params = dict(model.named_parameters())
    for layout in partition(model, 3):
        flat = layout.flatten(params)
        assert flat.dtype == np.float32 and flat.shape == (layout.numel,)
        flat.setflags(write=False)  # as Ray's object store hands it over
        for name, value in layout.unflatten(flat).items():
            assert torch.equal(value, params[name].detach())


def simulate(bound: float, *, workers: int, steps: int, seed: int) -> tuple[list[int], int]:
    """Workers of random speeds take steps whenever the rule lets them; return every
    gap at which a step started, and how often a ready worker had to wait."""
    rng = random.Random(seed)
    rule = StalenessBound(workers=workers, bound=bound, total_steps=steps)
    speed = [rng.uniform(0.2, 5.0) for _ in range(workers)]
    next_ready = [rng.expovariate(speed[w]) for w in range(workers)]
    gaps, blocked = [], 0
    while rule.slowest() < steps:
        w = min((w for w in range(workers) if rule.clocks[w] < steps), key=lambda w: next_ready[w])
        if not rule.may_start(w):
            blocked += 1
            # it waits until the slowest catches up: let the slowest step instead
            slow = min(
                (v for v in range(workers) if rule.clocks[v] < steps), key=lambda v: rule.clocks[v]
            )
            next_ready[w] = next_ready[slow] + 1e-9
            continue
        gaps.append(rule.gap(w))
        rule.advance(w, rule.clocks[w] + 1)
        next_ready[w] += rng.expovariate(speed[w])
    return gaps, blocked


@pytest.mark.parametrize("seed", range(40))
def test_ssp_never_lets_a_worker_run_more_than_s_clocks_ahead(seed: int) -> None:
    rng = random.Random(seed)
    s = rng.randint(0, 4)
    gaps, blocked = simulate(float(s), workers=rng.randint(2, 6), steps=60, seed=seed)
    assert max(gaps) <= s
    # With speeds up to 25× apart over 60 steps, the fast ones hit the bound.
    assert blocked > 0


def test_async_never_blocks_and_bsp_moves_in_lockstep() -> None:
    gaps, blocked = simulate(math.inf, workers=4, steps=50, seed=1)
    assert blocked == 0 and max(gaps) > 5
    gaps, _ = simulate(bound_for("bsp", 0), workers=4, steps=50, seed=1)
    assert max(gaps) == 0


def test_finished_workers_do_not_hold_back_the_rest() -> None:
    rule = StalenessBound(workers=2, bound=1, total_steps=3, clocks=[3, 0])
    assert rule.slowest() == 0 and rule.may_start(1)
    rule = StalenessBound(workers=2, bound=1, total_steps=3, clocks=[1, 3])
    assert rule.may_start(0)


def test_bsp_turn_waits_for_the_others_even_before_the_workers_own_advance_runs() -> None:
    """Ray may run an async actor's calls out of order: a worker's `wait_turn` for step 1
    can reach the board before its `advance` for step 0. It must still wait until the
    other worker has pushed step 0 (else it pulls parameters missing that push)."""

    async def scenario() -> list[str]:
        board = ClockBoard(workers=2, bound=bound_for("bsp", 0), total_steps=5)
        events: list[str] = []

        async def worker0() -> None:
            await board.wait_turn(0, 1)  # its advance(0, 1) has not run yet
            events.append("worker 0 starts step 1")

        task = asyncio.create_task(worker0())
        await asyncio.sleep(0.01)
        events.append("worker 1 pushed step 0")
        await board.advance(1, 1, loss=1.0, versions=[1])
        await asyncio.wait_for(task, timeout=5)
        await board.advance(0, 1, loss=1.0, versions=[1])  # the late advance changes nothing
        assert board.rule.clocks == [1, 1]
        return events

    assert asyncio.run(scenario()) == ["worker 1 pushed step 0", "worker 0 starts step 1"]


def ps_spec(**strategy: Any) -> dict[str, Any]:
    return {
        "model": {"n_layer": 1},
        "optim": {"grad_clip": 0},
        "strategy": {"kind": "ps", **strategy},
    }


def error_of(raw: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        config_from_dict(raw)
    return str(info.value)


@pytest.mark.parametrize(
    ("strategy", "expected"),
    [
        (
            {"staleness_bound": 2},
            "strategy.staleness_bound=2 needs strategy.consistency=ssp (a clock bound) or "
            "strategy.reject_beyond_bound=true; got async",
        ),
        ({"consistency": "eventual"}, "strategy.consistency='eventual' is not one of async"),
        ({"consistency": "bsp", "reject_beyond_bound": True}, "bsp pushes are never stale"),
        ({"pull_every": 0}, "strategy.pull_every=0 is out of range; allowed: >= 1"),
        ({"consistency": "bsp", "pull_every": 2}, "allowed: 1 (every round starts from"),
        ({"staleness_lr": "exp"}, "strategy.staleness_lr='exp' is not one of none, inverse"),
        (
            {"local_servers": "each"},
            "strategy.local_servers='each' is out of range; allowed: none, per_node or a "
            "count >= 1",
        ),
        ({"local_servers": 0}, "strategy.local_servers='0' is out of range; allowed: none"),
        ({"local_servers": 3}, "strategy.local_servers='3' is out of range; allowed: at most"),
        ({"local_servers": 2, "sync_every": 0}, "strategy.sync_every=0 is out of range"),
        ({"local_servers": 2, "max_local_staleness": -1}, "max_local_staleness=-1 is out of"),
        ({"sync_every": 4}, "but strategy.local_servers=none; allowed: per_node or a count"),
        (
            {"local_servers": "per_node", "consistency": "bsp", "sync_every": 2},
            "with strategy.consistency=bsp: a bsp local server sends each clock",
        ),
    ],
)
def test_invalid_parameter_server_specs_are_refused(
    strategy: dict[str, Any], expected: str
) -> None:
    assert expected in error_of(ps_spec(**strategy))


def test_more_shards_than_parameter_tensors_are_refused_before_ray_starts() -> None:
    cfg = config_from_dict(ps_spec(num_shards=99))  # the spec alone does not know the model
    model = build_model(cfg.model, vocab_size=cfg.data.vocab_size, seed=0)
    with pytest.raises(ConfigError, match=r"strategy\.num_shards=99 is more than the model's 17 "):
        check_shards(cfg, model)
    check_shards(config_from_dict(ps_spec(num_shards=17)), model)


def test_parameter_server_refuses_gradient_clipping() -> None:
    raw = ps_spec()
    raw["optim"] = {}
    assert "optim.grad_clip=1.0 is not supported with strategy.kind=ps" in error_of(raw)


def test_ssp_spec_with_compression_is_valid() -> None:
    cfg = config_from_dict(
        {**ps_spec(consistency="ssp", staleness_bound=2), "compression": {"kind": "topk"}}
    )
    assert cfg.strategy.staleness_bound == 2 and cfg.compression.kind == "topk"


def test_local_servers_group_workers_by_node_or_round_robin_and_bound_the_lag() -> None:
    per_node = config_from_dict(ps_spec(local_servers="per_node"))
    assert worker_groups(per_node, ["b", "a", "b", "a"]) == [[0, 2], [1, 3]]
    assert worker_groups(per_node, ["a", "a", "a", "a"]) == [[0, 1, 2, 3]]
    raw = ps_spec(local_servers=3)  # a YAML number: the field holds the text
    raw["scaling"] = {"num_workers": 4}
    counted = config_from_dict(raw)
    assert counted.strategy.local_servers == "3"
    assert worker_groups(counted, ["a"] * 4) == [[0, 3], [1], [2]]
    assert config_from_dict(config_to_dict(counted)) == counted

    def lag(**strategy: Any) -> float:
        return clock_lag_bound(config_from_dict(ps_spec(**strategy)))

    assert lag() == math.inf  # async
    assert lag(consistency="bsp") == 0
    assert lag(consistency="ssp", staleness_bound=2, pull_every=3) == 2 + 2
    local = {"local_servers": "per_node", "sync_every": 4, "max_local_staleness": 1}
    assert lag(consistency="ssp", staleness_bound=2, **local) == 2 + 1 + 3
