"""Runs the training loop in N local processes over gloo, without Ray.

The harness of the `tests/dist/` layer and of `benchmarks/` (no `trainstack` command
runs through it): it shows a strategy's math with real collectives and none of Ray's
start-up cost. Checkpoints go to `storage/name` as under Ray; rank 0 also leaves the
final weights, the summary and the run's events in `out_dir` (`model.pt`,
`summary.json`, `events.jsonl`).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainstack import checkpoint as ckpt
from trainstack.config import ConfigError, JobConfig, config_from_dict, config_to_dict
from trainstack.models.lora import whole_weights
from trainstack.runtime.checkpointing import DirectoryCheckpointStore
from trainstack.runtime.loop import train
from trainstack.runtime.preflight import preflight
from trainstack.storage import is_store_uri
from trainstack.strategies import WorkerContext

PRELOADED = (
    __name__,
    "trainstack.strategies.ddp",
    "trainstack.strategies.zero",
    "trainstack.strategies.fsdp",
    "trainstack.strategies.pipeline",
    # Imported on first use by a job that needs them, each costs a process seconds
    # (transformers' modeling code about 2 s, DeepSpeed 1 s more): imported once in the
    # fork server instead of in every process of every Hugging Face or DeepSpeed run. A
    # missing optional one is skipped (the fork server ignores an ImportError).
    "transformers.modeling_utils",
    "deepspeed",
)
"""Modules the fork server imports once, before it forks any process (a job imports
only its own strategy; the rest are there for the jobs that need them)."""


def start_processes(worker: Callable[..., None], *, args: tuple[Any, ...], nprocs: int) -> None:
    """Run `worker(rank, *args)` in `nprocs` processes forked from a fork server that has
    imported trainstack, torch and `PRELOADED` once (each process starts in milliseconds,
    not seconds of imports); raises if one fails. The fork server is started on first use
    and reused after; its preload is set before it starts."""
    multiprocessing.set_forkserver_preload(list(PRELOADED))
    context = mp.start_processes(
        worker, args=args, nprocs=nprocs, start_method="forkserver", join=False
    )
    join(context)


def join(context: mp.ProcessContext) -> None:
    """Wait for every process of `context`; raise for one that failed: the one that ended
    on its own, if one did."""
    try:
        while not context.join():
            pass
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as failure:
        # The failure seen first may be a consequence: a rank that died (an injected
        # fault's exit) resets its peers' connections, and which of them the join finds
        # first is a race. Name the rank that ended on its own, as if it had been first.
        ended = _ended_on_its_own(context)
        if ended is None or ended == failure.error_index:
            raise
        code = context.processes[ended].exitcode
        raise mp.ProcessExitedException(
            f"process {ended:d} terminated with exit code {code:d}",
            error_index=ended,
            error_pid=context.processes[ended].pid,
            exit_code=code,
        ) from failure


def _ended_on_its_own(context: mp.ProcessContext) -> int | None:
    """The first process that exited with a code of its own (`os._exit`, as an injected
    fault does), not by raising (which leaves an error file and exits 1) nor by a signal
    (the others, once one failed)."""
    for index, process in enumerate(context.processes):
        code = process.exitcode
        if code is not None and code > 0 and not os.access(context.error_files[index], os.R_OK):
            return index
    return None


def rendezvous(folder: Path) -> str:
    """A `torch.distributed` init method for processes on this machine: a new file store
    in `folder` (no port to choose, so none another process can take first; gloo's own
    connections bind port 0 and exchange their addresses through the store)."""
    folder.mkdir(parents=True, exist_ok=True)
    return f"file://{folder / f'rendezvous-{uuid.uuid4().hex}'}"


def run_processes(
    cfg: JobConfig,
    *,
    world_size: int,
    out_dir: Path,
    resume_from: Path | None = None,
    ranks_per_node: int = 0,
) -> dict[str, Any]:
    """Train `cfg` on `world_size` CPU processes; return rank 0's summary.
    `ranks_per_node` > 0 simulates nodes: ranks [k·n, (k+1)·n) say they share node k
    (for node-aware collectives); 0: all on one.

    Raises if a process dies (e.g. an injected fault); running it again resumes. Raises
    ConfigError for checkpoints in an object store (these processes commit checkpoints
    by renaming a local directory).
    """
    if is_store_uri(cfg.checkpoint.storage_path):
        raise ConfigError(
            f"checkpoint.storage_path={cfg.checkpoint.storage_path!r}: the local process "
            "harness writes checkpoints to a directory, not an object store; allowed: a "
            "filesystem path here, or train on Ray (`trainstack run`) to use the store"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    report = preflight(cfg)
    cfg = report.cfg
    ckpt.checked_start(
        cfg,
        resume_from=resume_from,
        shapes=report.shapes,
        data_fingerprint=report.data_fingerprint,
    )
    init_method = rendezvous(out_dir / ".rendezvous")
    args = (config_to_dict(cfg), world_size, init_method, str(out_dir), resume_from, ranks_per_node)
    if world_size == 1 and not cfg.faults.kill_at_steps and not cfg.faults.random_kills:
        _worker(0, *args)  # in-process: no start-up cost for single-process references
    else:
        start_processes(_worker, args=args, nprocs=world_size)
    summary: dict[str, Any] = json.loads((out_dir / "summary.json").read_text())
    return summary


def _worker(
    rank: int,
    spec: dict[str, Any],
    world_size: int,
    init_method: str,
    out_dir: str,
    resume_from: Path | None,
    ranks_per_node: int,
) -> None:
    distributed = world_size > 1
    if distributed:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    try:
        cfg = config_from_dict(spec)
        out = Path(out_dir)
        run_dir = ckpt.run_dir_for(cfg)
        run_dir.mkdir(parents=True, exist_ok=True)

        def on_event(record: dict[str, Any]) -> None:
            with (out / "events.jsonl").open("a") as f:
                f.write(json.dumps(record) + "\n")

        outcome = train(
            cfg,
            WorkerContext(
                rank=rank,
                world_size=world_size,
                local_rank=rank % ranks_per_node if ranks_per_node else rank,
                device=torch.device("cpu"),
                node=f"node-{rank // ranks_per_node}" if ranks_per_node else "local",
            ),
            run_dir=run_dir,
            store=DirectoryCheckpointStore(run_dir, rank=rank, distributed=distributed),
            resume_from=resume_from,
            on_event=on_event,
        )
        if rank == 0:
            final = ckpt.resolve(run_dir)  # the checkpoint the run ended with
            torch.save(whole_weights(final), out / "model.pt")
            (out / "summary.json").write_text(json.dumps(outcome.summary))
    finally:
        if distributed:
            dist.destroy_process_group()
