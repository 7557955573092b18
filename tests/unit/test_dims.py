"""The job's grid `[pp, dp_replicate, dp_shard, tp]`: what each strategy kind lays out,
and that every rank has one place in it and back."""

import pytest

from trainstack.config import config_from_dict
from trainstack.dims import ParallelDims

GPT = {"kind": "gpt", "n_layer": 4, "n_head": 4, "n_embd": 32, "block_size": 16}


def spec(workers: int, **strategy: object) -> dict:
    return {
        "model": GPT,
        "data": {"vocab_size": 16},
        "train": {"global_batch_size": 16, "micro_batch_size": 2},
        "strategy": strategy,
        "scaling": {"num_workers": workers},
    }


@pytest.mark.parametrize(
    ("raw", "grid", "replicas"),
    [
        (spec(4, kind="ddp"), (1, 4, 1, 1), 4),
        (spec(4, kind="zero", stage=2), (1, 1, 4, 1), 4),
        (spec(8, kind="fsdp", data_parallel_replicate=2, tensor_parallel=2), (1, 2, 2, 2), 4),
        (
            {
                **spec(8, kind="pipeline", stages=2, data_parallel=2, tensor_parallel=2),
                "train": {"global_batch_size": 16, "micro_batch_size": 2},
            },
            (2, 1, 2, 2),
            2,
        ),
    ],
)
def test_each_kind_fills_the_grid_with_its_workers(
    raw: dict, grid: tuple[int, int, int, int], replicas: int
) -> None:
    cfg = config_from_dict(raw)
    dims = cfg.dims
    assert (dims.pp, dims.dp_replicate, dims.dp_shard, dims.tp) == grid
    assert dims.world_size == cfg.scaling.num_workers
    assert cfg.data_parallel_size == dims.dp == replicas


@pytest.mark.parametrize("grid", [(1, 1, 1, 1), (2, 1, 3, 2), (3, 2, 2, 1), (2, 2, 2, 2)])
def test_every_rank_has_one_place_and_tp_is_innermost(grid: tuple[int, int, int, int]) -> None:
    p, r, s, t = grid
    dims = ParallelDims(pp=p, dp_replicate=r, dp_shard=s, tp=t)
    places = [dims.coords(rank) for rank in range(dims.world_size)]
    assert len({(c.pp, c.dp_replicate, c.dp_shard, c.tp) for c in places}) == dims.world_size
    for rank, c in enumerate(places):
        # ((pp × r + replicate) × s + shard) × t + tp, written out the long way
        assert rank == ((c.pp * r + c.dp_replicate) * s + c.dp_shard) * t + c.tp
        assert c.dp == c.dp_replicate * s + c.dp_shard
        assert dims.rank(pp=c.pp, dp=c.dp, tp=c.tp) == rank
    # a tensor-parallel group is t neighbours that see one replica's samples
    assert [c.dp for c in places[:t]] == [0] * t
    with pytest.raises(ValueError, match="outside a world of"):
        dims.coords(dims.world_size)
