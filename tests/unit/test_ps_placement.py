"""Where parameter-server shards go, decided from Ray's node list (stubbed here):
`strategy.ps_cpus` auto, and the soft preference for nodes that do not train."""

from typing import Any

import pytest

from trainstack.config import ConfigError, config_from_dict
from trainstack.ps import placement

NODE_IDS = {name: f"{i + 1:02x}" * 28 for i, name in enumerate(["head", "svc", "big", "w1"])}
"""Valid 28-byte hex node ids, by a readable name."""


def node(name: str, *, alive: bool = True, **resources: float) -> dict[str, Any]:
    return {"NodeID": NODE_IDS[name], "Alive": alive, "Resources": resources}


def job(shards: int = 2, ps_cpus: float = -1, **per_worker: float) -> Any:
    return config_from_dict(
        {
            "strategy": {"kind": "ps", "num_shards": shards, "ps_cpus": ps_cpus},
            "optim": {"grad_clip": 0},
            "scaling": {"resources_per_worker": per_worker},
        }
    )


def preferred(strategies: list[Any]) -> list[str | None]:
    """Each shard's preferred node by name (None: Ray's own choice)."""
    by_id = {v: k for k, v in NODE_IDS.items()}
    return [by_id[s.node_id] if not isinstance(s, str) else None for s in strategies]


def test_ps_cpus_auto_is_0_on_one_machine_and_1_on_a_cluster(monkeypatch: Any) -> None:
    monkeypatch.setattr(placement.ray, "nodes", lambda: [node("head", CPU=8)])
    assert placement.shard_cpus(job()) == 0.0
    monkeypatch.setattr(
        placement.ray, "nodes", lambda: [node("head", CPU=0), node("w1", alive=False, CPU=1)]
    )
    assert placement.shard_cpus(job()) == 0.0  # a lost node is not a cluster
    monkeypatch.setattr(placement.ray, "nodes", lambda: [node("head", CPU=0), node("w1", CPU=1)])
    assert placement.shard_cpus(job()) == 1.0
    assert placement.shard_cpus(job(ps_cpus=0.5)) == 0.5


def test_shards_are_dealt_round_robin_to_nodes_that_do_not_train_while_they_have_room(
    monkeypatch: Any,
) -> None:
    nodes = [
        node("head", CPU=0),  # no CPUs: no room
        node("svc", CPU=1),
        node("big", CPU=2, gpu_box=1),  # lacks the workers' `trainer` resource
        node("w1", CPU=4, trainer=1),  # a training node: never preferred
    ]
    monkeypatch.setattr(placement.ray, "nodes", lambda: nodes)
    got = placement.shard_strategies(job(shards=5, trainer=1), cpus=1.0)
    assert preferred(got) == ["svc", "big", "big", None, None]
    assert all(s.soft and s._spill_on_unavailable for s in got[:3])
    # Reserving no CPUs, every node with CPUs that does not train has room for all.
    assert preferred(placement.shard_strategies(job(shards=3, trainer=1), cpus=0.0)) == [
        "svc",
        "big",
        "svc",
    ]


def test_without_resources_per_worker_no_node_is_preferred(monkeypatch: Any) -> None:
    monkeypatch.setattr(placement.ray, "nodes", lambda: [node("svc", CPU=4), node("w1", CPU=4)])
    assert preferred(placement.shard_strategies(job(shards=2), cpus=1.0)) == [None, None]


@pytest.mark.parametrize("value", [-0.5, -2, 2000])
def test_ps_cpus_out_of_range_is_one_clear_line(value: float) -> None:
    with pytest.raises(ConfigError, match=r"strategy.ps_cpus=.*allowed"):
        job(ps_cpus=value)
