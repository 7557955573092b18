"""The fsdp mesh `[dp_replicate, dp_shard, tp]`: which layouts the spec admits, what it
refuses with one line, and which samples each rank sees."""

import pytest

from trainstack.config import ConfigError, config_from_dict
from trainstack.runtime.capacity import model_state


def fsdp(workers: int, **strategy: object) -> dict:
    return {
        "model": {"kind": "gpt", "n_layer": 2, "n_head": 4, "n_embd": 32, "block_size": 16},
        "data": {"vocab_size": 16},
        "train": {"global_batch_size": 16, "micro_batch_size": 2},
        "strategy": {"kind": "fsdp", **strategy},
        "scaling": {"num_workers": workers},
    }


@pytest.mark.parametrize(
    ("workers", "strategy", "layout", "replicas"),
    [
        (4, {}, (1, 4, 1), 4),
        (4, {"tensor_parallel": 2}, (1, 2, 2), 2),
        (4, {"data_parallel_replicate": 2}, (2, 2, 1), 4),
        (8, {"data_parallel_replicate": 2, "tensor_parallel": 2}, (2, 2, 2), 4),
        (2, {"tensor_parallel": 2}, (1, 1, 2), 1),
    ],
)
def test_mesh_takes_the_shard_degree_from_what_the_workers_leave(
    workers: int, strategy: dict, layout: tuple[int, int, int], replicas: int
) -> None:
    cfg = config_from_dict(fsdp(workers, **strategy))
    mesh = cfg.dims
    assert (mesh.dp_replicate, mesh.dp_shard, mesh.tp) == layout
    assert mesh.world_size == workers
    assert cfg.data_parallel_size == replicas == mesh.dp
    t = mesh.tp  # tp innermost: a tensor-parallel group's ranks see one replica's samples
    assert [cfg.data_parallel_rank(rank) for rank in range(workers)] == [
        rank // t for rank in range(workers)
    ]


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (fsdp(6, tensor_parallel=4), "scaling.num_workers=6 must be a multiple of"),
        (
            fsdp(3, tensor_parallel=3),
            "model.n_head=4 is not divisible by strategy.tensor_parallel=3",
        ),
        (
            {**fsdp(2, tensor_parallel=2), "data": {"vocab_size": 15}},
            "data.vocab_size=15 is not divisible by strategy.tensor_parallel=2",
        ),
        (fsdp(4, tensor_parallel=0), "strategy.tensor_parallel=0 is out of range"),
        (
            {**fsdp(2), "strategy": {"kind": "ddp", "tensor_parallel": 2}},
            "which strategy.kind=ddp does not use; set strategy.kind=fsdp",
        ),
        (
            {**fsdp(2, tensor_parallel=2), "model": {"kind": "mlp"}},
            "model.kind=mlp has none",
        ),
        (fsdp(2, offload_optimizer="cpu"), "strategy.offload_optimizer=cpu is DeepSpeed ZeRO's"),
        (
            fsdp(2, shard_replicas=True),
            "strategy.shard_replicas=true is for strategy.kind=pipeline",
        ),
        (
            {
                **fsdp(4),
                "strategy": {
                    "kind": "pipeline",
                    "engine": "deepspeed",
                    "data_parallel": 2,
                    "shard_replicas": True,
                },
            },
            "strategy.shard_replicas=true shards a pipeline's replicas with FSDP2, which needs "
            "strategy.engine=torch",
        ),
        (
            {
                **fsdp(4),
                "strategy": {"kind": "pipeline", "data_parallel": 2, "data_parallel_replicate": 2},
            },
            "strategy.data_parallel_replicate=2 groups a pipeline's sharded replicas",
        ),
        (
            {
                **fsdp(6),
                "strategy": {
                    "kind": "pipeline",
                    "data_parallel": 3,
                    "data_parallel_replicate": 2,
                    "shard_replicas": True,
                },
            },
            "strategy.data_parallel=3 must be a multiple of strategy.data_parallel_replicate=2",
        ),
        ({**fsdp(2), "compression": {"kind": "topk"}}, "compression.kind=topk compresses DDP's"),
        (
            {
                **fsdp(4, tensor_parallel=2),
                "train": {"global_batch_size": 6, "micro_batch_size": 2},
            },
            "train.global_batch_size=6 is not divisible by",
        ),
    ],
)
def test_layouts_that_cannot_run_are_refused_with_one_line(raw: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        config_from_dict(raw)
    assert "\n" not in str(err.value)


def test_capacity_counts_one_shard_of_weights_gradients_and_adam_state() -> None:
    whole = model_state(config_from_dict({**fsdp(1), "scaling": {"num_workers": 1}}), 1000)
    tp2xdp2 = model_state(config_from_dict(fsdp(4, tensor_parallel=2)), 1000)
    hsdp = model_state(config_from_dict(fsdp(4, data_parallel_replicate=2)), 1000)
    assert whole.per_worker == (4 + 4 + 8) * 1000
    assert tp2xdp2.per_worker == whole.per_worker // 4  # s 2 × t 2
    assert hsdp.per_worker == whole.per_worker // 2  # sharded over s = 2, replicated × 2
