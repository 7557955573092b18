"""Runs the training loop in N local processes over gloo, without Ray.

This is the `tests/dist/` layer's harness: it shows a strategy's math with real
collectives and none of Ray's start-up cost. Rank 0 saves the final model weights
and the summary into `out_dir`.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainstack.config import JobConfig, config_from_dict, config_to_dict
from trainstack.runtime.loop import train
from trainstack.strategies import WorkerContext


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_processes(cfg: JobConfig, *, world_size: int, out_dir: Path) -> dict[str, Any]:
    """Train `cfg` on `world_size` CPU processes; return rank 0's summary.

    The final weights are in `out_dir / "model.pt"` (a plain state dict).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = config_to_dict(cfg)
    if world_size == 1:
        _worker(0, spec, 1, 0, str(out_dir))
    else:
        mp.spawn(_worker, args=(spec, world_size, free_port(), str(out_dir)), nprocs=world_size)
    summary: dict[str, Any] = json.loads((out_dir / "summary.json").read_text())
    return summary


def _worker(rank: int, spec: dict[str, Any], world_size: int, port: int, out_dir: str) -> None:
    if world_size > 1:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
        )
    try:
        ctx = WorkerContext(
            rank=rank, world_size=world_size, local_rank=rank, device=torch.device("cpu")
        )
        outcome = train(config_from_dict(spec), ctx)
        if rank == 0:
            torch.save(outcome.strategy.unwrapped_model().state_dict(), Path(out_dir) / "model.pt")
            (Path(out_dir) / "summary.json").write_text(json.dumps(outcome.summary))
    finally:
        if world_size > 1:
            dist.destroy_process_group()
