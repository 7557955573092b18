"""Context parallelism's parts without processes: which positions each rank holds, where
a rank sits in the grid with a context-parallel dimension, and the spec's refusals."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from trainstack.config import ConfigError, config_from_dict
from trainstack.strategies.context_parallel import zigzag_positions


def test_each_rank_holds_an_early_and_a_late_chunk_and_together_every_position() -> None:
    held = [zigzag_positions(16, size=4, rank=r) for r in range(4)]
    assert held[0].tolist() == [0, 1, 14, 15] and held[3].tolist() == [6, 7, 8, 9]
    assert torch.equal(torch.sort(torch.cat(held)).values, torch.arange(16))
    # the causal work (keys each query sees, summed) is the same on every rank
    assert len({int((p + 1).sum()) for p in held}) == 1


def job(**strategy: Any) -> dict[str, Any]:
    return {
        "model": {"kind": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16},
        "data": {"vocab_size": 16},
        "strategy": {"kind": "fsdp", "context_parallel": 2, **strategy},
        "scaling": {"num_workers": 4},
    }


def test_the_grid_puts_the_context_parallel_ranks_next_to_each_other() -> None:
    dims = config_from_dict(job()).dims
    assert (dims.dp_shard, dims.cp, dims.world_size) == (2, 2, 4)
    coords = [dims.coords(r) for r in range(4)]
    assert [(c.dp, c.cp) for c in coords] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [dims.rank(dp=c.dp, cp=c.cp) for c in coords] == [0, 1, 2, 3]
    assert config_from_dict(job()).data_parallel_size == 2  # the cp ranks share samples


def test_with_tensor_parallelism_a_context_group_is_the_same_tp_rank_of_each() -> None:
    """cp 2 × tp 2 on 4 ranks: tp innermost, so the context-parallel groups are {0, 2}
    and {1, 3}, and the FSDP mesh is the 2 × 2 grid of (dp_shard × cp, tp)."""
    dims = config_from_dict(job(tensor_parallel=2)).dims
    assert (dims.dp_shard, dims.cp, dims.tp) == (1, 2, 2)
    groups = {
        (c.dp, c.tp): [
            r for r in range(4) if (dims.coords(r).dp, dims.coords(r).tp) == (c.dp, c.tp)
        ]
        for c in map(dims.coords, range(4))
    }
    assert sorted(groups.values()) == [[0, 2], [1, 3]]


def changed(raw: dict[str, Any], section: str, **values: Any) -> dict[str, Any]:
    return {**raw, section: {**raw.get(section, {}), **values}}


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            changed(job(), "strategy", kind="ddp"),
            "strategy.context_parallel=2 splits every row's tokens over fsdp's mesh; "
            "strategy.kind=ddp does not lay one",
        ),
        (
            changed(job(), "model", block_size=18),
            "strategy.context_parallel=2: model.block_size=18 must be divisible by 2 × 2 = 4",
        ),
        (
            changed(job(), "scaling", num_workers=3),
            "scaling.num_workers=3 must be a multiple of strategy.data_parallel_replicate × "
            "strategy.context_parallel × strategy.tensor_parallel = 1 × 2 × 1 = 2",
        ),
        (
            changed(job(data_parallel_replicate=2), "scaling", num_workers=4),
            "strategy.context_parallel=2 with strategy.data_parallel_replicate set: context "
            "parallelism does not combine with it yet",
        ),
        (
            changed(job(), "model", dropout=0.1),
            "strategy.context_parallel=2 with model.dropout set",
        ),
        (
            changed(job(), "model", kind="hf", hf={"model_type": "mistral"}),
            "strategy.context_parallel=2 runs attention as a ring over the ranks, for "
            "trainstack's GPT and the Hugging Face families llama, qwen2, qwen3",
        ),
    ],
)
def test_what_context_parallelism_cannot_run_is_refused_in_one_line(
    raw: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError) as err:
        config_from_dict(raw)
    assert str(err.value).startswith(message), str(err.value)
    assert "\n" not in str(err.value)
