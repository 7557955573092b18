"""Tensor parallelism's collectives, counted by torch's CommDebugMode on 2 gloo ranks:
with sequence parallelism each block's forward is 2 all-gathers (the attention's and the
MLP's input) and 2 reduce-scatters (their outputs), and no all-reduce; the embeddings
add 2 reduce-scatters and the LM head 1 all-gather (its logits stay sharded by
vocabulary, for `loss_parallel`). The backward mirrors them."""

import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode

from trainstack.config import ModelConfig
from trainstack.models.gpt import GPT
from trainstack.runtime.local import free_port
from trainstack.strategies.tensor_parallel import apply_tensor_parallel

LAYERS = 3


def count(comm: CommDebugMode) -> dict[str, int]:
    kinds = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
    for op, n in comm.get_comm_counts().items():
        for kind in kinds:
            if kind in str(op):
                kinds[kind] += n
    return kinds


def worker(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    cfg = ModelConfig(kind="gpt", n_layer=LAYERS, n_head=2, n_embd=16, block_size=8)
    model = GPT(cfg, vocab_size=8)
    apply_tensor_parallel(model, init_device_mesh("cpu", (2,)), loss_parallel=True)
    x = torch.randint(0, 8, (2, 8), generator=torch.Generator().manual_seed(1))
    forward, backward = CommDebugMode(), CommDebugMode()
    with forward:
        logits = model(x)
    with backward:
        logits.float().pow(2).mean().backward()
    if rank == 0:
        Path(out).write_text(json.dumps({"forward": count(forward), "backward": count(backward)}))
    dist.destroy_process_group()


def test_sequence_parallel_blocks_issue_two_all_gathers_and_two_reduce_scatters(
    tmp_path: Path,
) -> None:
    out = tmp_path / "counts.json"
    mp.spawn(worker, args=(free_port(), str(out)), nprocs=2)
    counts = json.loads(out.read_text())
    assert counts["forward"] == {
        "all_gather": 2 * LAYERS + 1,  # + the LM head's input
        "reduce_scatter": 2 * LAYERS + 2,  # + token and position embeddings
        "all_reduce": 0,
    }
    backward = counts["backward"]
    # The backward of an all-gather is a reduce-scatter and the other way round.
    assert backward["reduce_scatter"] >= 2 * LAYERS + 1
    assert backward["all_gather"] >= 2 * LAYERS
