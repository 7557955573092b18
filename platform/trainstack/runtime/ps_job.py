"""Runs a `ps` job on plain Ray actors: S shards, N workers and a clock board (and with
`strategy.local_servers`, local servers between the workers and the shards).

The driver builds the model once (the seed fixes its weights), partitions it over the
shards by bytes, starts the actors where ps/placement.py says, and waits for every
worker to push its `train.steps` steps, showing progress from the board. A worker
that dies is restarted by Ray (`failure.max_failures` restarts per worker, -1
unlimited) and its `run` is called again; shards are always restarted and restore
their own checkpoints. At the end the driver pulls the final parameters, evaluates
them on held-out data, writes them as a standard checkpoint (`model.pt`, loadable by
any strategy) and returns the summary: updates/s, staleness, per-worker throughput,
restarts and losses.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from trainstack import checkpoint as ckpt
from trainstack.config import JobConfig, config_to_dict
from trainstack.data import build_corpus
from trainstack.data.bits_per_byte import summary_bits_per_byte
from trainstack.data.sharding import eval_batches
from trainstack.models import build_model, num_params
from trainstack.ps.clock import ActorNames, ClockBoard, bound_for
from trainstack.ps.local import LocalServer, worker_groups
from trainstack.ps.partition import ShardLayout, partition
from trainstack.ps.placement import OWN_RESOURCES, shard_cpus, shard_strategies
from trainstack.ps.shard import ParameterServerShard
from trainstack.ps.worker import ParameterServerWorker
from trainstack.runtime.capacity import start_timeout_message
from trainstack.runtime.checkpointing import DirectoryCheckpointStore
from trainstack.runtime.cluster import on_this_node
from trainstack.runtime.loop import data_epoch
from trainstack.runtime.progress import ProgressDisplay
from trainstack.tasks import EvalSums, build_task, eval_mode, evaluate


class WorkerFailedError(RuntimeError):
    """A worker failed more often than `failure.max_failures` allows."""


def run_parameter_server(
    cfg: JobConfig,
    *,
    display: ProgressDisplay | None = None,
    on_progress: Any = None,
    time_budget_s: float | None = None,
) -> dict[str, Any]:
    """Train `cfg` (strategy.kind ps) on the connected Ray cluster; return the summary.

    With `time_budget_s` (benchmarks) workers stop after that many seconds of training
    even if they have steps left."""
    wall_start = time.perf_counter()
    run_dir = ckpt.run_dir_for(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    # Shard files are a restart point within one run; a new run starts from the seed.
    shutil.rmtree(run_dir / "ps", ignore_errors=True)
    spec = config_to_dict(cfg)
    s, workers = cfg.strategy, cfg.scaling.num_workers
    model = build_model(cfg.model, vocab_size=cfg.data.vocab_size, seed=cfg.train.seed)
    layouts = partition(model, s.num_shards)

    # Actors find each other by name: an actor handle among a restartable actor's
    # constructor arguments lives in the object store, where a restart may not find it.
    names = ActorNames(prefix=f"trainstack-ps-{cfg.name}-{uuid.uuid4().hex[:6]}")
    board: Any = (
        ray.remote(ClockBoard)
        .options(
            name=names.board,
            num_cpus=0,
            max_concurrency=4 * workers + 8,
            scheduling_strategy=on_this_node(),  # lives and dies with the driver
        )
        .remote(
            workers=workers,
            bound=bound_for(s.consistency, s.staleness_bound),
            total_steps=cfg.train.steps,
        )
    )
    # Shards prefer nodes that do not train (ps/placement.py): a lost training node then
    # costs its workers' steps, not a shard's updates too.
    cpus = shard_cpus(cfg)
    shards: list[Any] = [
        ray.remote(ParameterServerShard)
        .options(
            name=names.shard(i),
            num_cpus=cpus,
            max_restarts=-1,
            max_task_retries=-1,
            scheduling_strategy=placement,
        )
        .remote(
            index=i,
            layout=layout,
            spec=spec,
            checkpoint_dir=str(run_dir / "ps"),
            names=names,
        )
        for i, (layout, placement) in enumerate(
            zip(layouts, shard_strategies(cfg, cpus=cpus), strict=True)
        )
    ]
    worker_actors: list[Any] = [
        ray.remote(ParameterServerWorker)
        .options(
            name=names.worker(w),
            num_cpus=cfg.scaling.cpus_per_worker,
            num_gpus=1 if cfg.scaling.use_gpu else 0,  # Ray gives the actor its own GPU
            resources=dict(cfg.scaling.resources_per_worker),
            scheduling_strategy=OWN_RESOURCES,
            max_restarts=cfg.failure.max_failures,
            max_task_retries=-1,  # `run` starts again on the restarted worker
        )
        .remote(
            index=w,
            spec=spec,
            layouts=layouts,
            names=names,
            run_dir=str(run_dir),
        )
        for w in range(workers)
    ]
    if display is not None:
        sizes = ", ".join(f"{layout.numel:,}" for layout in layouts)
        display.note(
            f"parameter server ({s.consistency}): {workers} workers, {s.num_shards} shards "
            f"({sizes} parameters; {cpus:g} CPUs reserved by each)"
        )
    ready = [actor.__ray_ready__.remote() for actor in [*worker_actors, *shards]]
    try:
        ray.get(ready, timeout=cfg.scaling.start_timeout_s or None)
    except GetTimeoutError:  # no room: take back the actors still waiting for it
        for actor in [*worker_actors, *shards, board]:
            ray.kill(actor)
        raise WorkerFailedError(start_timeout_message(cfg)) from None
    locals_, local_of = _start_local_servers(cfg, worker_actors, spec, layouts, names, display)
    deadline = time.time() + time_budget_s if time_budget_s is not None else None

    def held_out_now() -> float | None:
        """The held-out loss of the shards' current parameters."""
        pulled = ray.get([shard.pull.remote(by_driver=True) for shard in shards])
        _load_final(model, layouts, [flat for _, flat, _ in pulled])
        return _held_out(cfg, model).get("eval_loss")

    reports = _run_workers(
        cfg,
        worker_actors,
        board,
        local_of=local_of,
        deadline=deadline,
        display=display,
        on_progress=on_progress,
        evaluate=held_out_now,
    )
    train_s = max(r["wall_s"] for r in reports)  # from the workers' first step: no start-up

    local_reports, locals_lost = _flush_local_servers(locals_)
    shard_reports = ray.get([shard.report.remote() for shard in shards])
    final = ray.get([shard.pull.remote(by_driver=True) for shard in shards])
    board_report = ray.get(board.report.remote())
    for actor in [*worker_actors, *locals_, *shards, board]:
        ray.kill(actor)
    _load_final(model, layouts, [flat for _, flat, _ in final])
    summary = _summary(
        cfg,
        model,
        reports=reports,
        shard_reports=shard_reports,
        local_reports=local_reports,
        locals_lost=locals_lost,
        board_report=board_report,
        train_s=train_s,
    )
    summary["final_checkpoint"] = str(_save_final(cfg, model, run_dir=run_dir, summary=summary))
    summary["wall_s"] = time.perf_counter() - wall_start
    summary["run_dir"] = str(run_dir)
    return summary


def _start_local_servers(
    cfg: JobConfig,
    workers: list[Any],
    spec: dict[str, Any],
    layouts: list[ShardLayout],
    names: ActorNames,
    display: ProgressDisplay | None,
) -> tuple[list[Any], list[int | None]]:
    """The local servers (none unless `strategy.local_servers`) and each worker's server.
    Per node: one on each node the workers landed on, pinned there (a soft preference
    does not hold a node whose CPUs the workers took); never restarted (ps/local.py)."""
    if cfg.strategy.local_servers == "none":
        return [], [None] * len(workers)
    nodes: list[str] = ray.get([worker.node.remote() for worker in workers])
    groups = worker_groups(cfg, nodes)
    per_node = cfg.strategy.local_servers == "per_node"
    servers: list[Any] = [
        ray.remote(LocalServer)
        .options(
            name=names.local(g),
            num_cpus=0,
            max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(nodes[group[0]], soft=False)
            if per_node
            else OWN_RESOURCES,
        )
        .remote(index=g, spec=spec, layouts=layouts, names=names, workers=group)
        for g, group in enumerate(groups)
    ]
    ray.get([server.__ray_ready__.remote() for server in servers])
    local_of: list[int | None] = [None] * len(workers)
    for g, group in enumerate(groups):
        for w in group:
            local_of[w] = g
    if display is not None:
        sizes = ", ".join(str(len(group)) for group in groups)
        where = "one per node" if per_node else "workers dealt round-robin"
        display.note(f"local servers: {len(groups)} ({where}; {sizes} workers)")
    return servers, local_of


def _flush_local_servers(servers: list[Any]) -> tuple[list[dict[str, Any]], list[int]]:
    """Have each live local server send what it holds (the run's end); their reports, and
    which servers were lost."""
    reports, lost = [], []
    for g, server in enumerate(servers):
        try:
            ray.get(server.flush.remote())
            reports.append(ray.get(server.report.remote()))
        except RayActorError:
            lost.append(g)
    return reports, lost


def _run_workers(
    cfg: JobConfig,
    actors: list[Any],
    board: Any,
    *,
    local_of: list[int | None],
    deadline: float | None,
    display: ProgressDisplay | None,
    on_progress: Any,
    evaluate: Callable[[], float | None],
) -> list[dict[str, Any]]:
    """Wait for every worker's `run`. Ray restarts a worker that dies (up to
    `failure.max_failures` times) and runs `run` again on it (task retries); a worker
    out of restarts fails the job."""
    pending = {actor.run.remote(deadline, local_of[w]): w for w, actor in enumerate(actors)}
    reports: list[dict[str, Any]] = [{} for _ in actors]
    start = time.perf_counter()
    last_shown = -1
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=0.5)
        for ref in ready:
            w = pending.pop(ref)
            try:
                reports[w] = ray.get(ref)
            except RayActorError as err:
                raise WorkerFailedError(
                    f"parameter-server worker {w} failed more often than "
                    f"failure.max_failures={cfg.failure.max_failures} allows; last error: "
                    f"{str(err).strip().splitlines()[0]}"
                ) from err
        last_shown = _show_progress(cfg, board, start, last_shown, display, on_progress, evaluate)
    return reports


def _show_progress(
    cfg: JobConfig,
    board: Any,
    start: float,
    last_shown: int,
    display: ProgressDisplay | None,
    on_progress: Any,
    evaluate: Callable[[], float | None],
) -> int:
    """Show the slowest worker's clock as the step when it crosses a log boundary, with
    the held-out loss when it also crosses an eval boundary (`log.eval_every_steps`)."""
    progress = ray.get(board.progress.remote())
    step = min(progress["clocks"])
    every = cfg.log.every_steps
    if step // every == last_shown // every and step != cfg.train.steps:
        return last_shown
    elapsed = time.perf_counter() - start
    done = sum(progress["clocks"])
    samples = done * cfg.train.global_batch_size / cfg.scaling.num_workers
    record = {
        "step": max(step, 1),
        "steps": cfg.train.steps,
        "loss": statistics.fmean(progress["recent_loss"])
        if progress["recent_loss"]
        else float("nan"),
        "tokens_per_s": samples * cfg.tokens_per_sample / elapsed if elapsed else 0.0,
        "samples_per_s": samples / elapsed if elapsed else 0.0,
        "mfu": None,
        "elapsed_s": elapsed,
    }
    evals = cfg.log.eval_every_steps
    if evals and step // evals > last_shown // evals and step < cfg.train.steps:
        record["eval_loss"] = evaluate()
    if display is not None and step > 0:
        display.update(record)
    if on_progress is not None:
        on_progress(record)
    return step


def _load_final(
    model: torch.nn.Module, layouts: list[ShardLayout], flats: list[np.ndarray]
) -> None:
    params = dict(model.named_parameters())
    with torch.no_grad():
        for layout, flat in zip(layouts, flats, strict=True):
            for name, value in layout.unflatten(flat).items():
                params[name].copy_(value)


def _held_out(cfg: JobConfig, model: torch.nn.Module) -> dict[str, float]:
    """The task's held-out metrics of `model` (the shards' parameters), on the driver."""
    if cfg.data.eval_samples == 0:
        return {}
    batches = eval_batches(
        build_corpus(cfg.data),
        count=cfg.data.eval_samples,
        seq_len=cfg.model.block_size,
        micro_batch_size=cfg.train.micro_batch_size,
        rank=0,
        world_size=1,
    )
    task = build_task(cfg)
    restore = eval_mode([model])
    sums = evaluate(task, model, batches, device=torch.device("cpu"))
    restore()
    return EvalSums.of(sums).metrics(task)


def _summary(
    cfg: JobConfig,
    model: Any,
    *,
    reports: list[dict[str, Any]],
    shard_reports: list[dict[str, Any]],
    local_reports: list[dict[str, Any]],
    locals_lost: list[int],
    board_report: dict[str, Any],
    train_s: float,
) -> dict[str, Any]:
    s = cfg.strategy
    staleness = np.array([t for r in shard_reports for t in r["staleness"]], dtype=np.int64)
    lr_factors = [f for r in shard_reports for f in r["lr_factors"]]
    updates = sum(r["version"] for r in shard_reports) / len(shard_reports)
    clocks = board_report["clocks"]
    samples = sum(clocks) * cfg.train.global_batch_size / cfg.scaling.num_workers
    evaluation = _held_out(cfg, model)
    eval_loss = evaluation.get("eval_loss")
    senders = [*reports, *local_reports]  # who pushed to the shards
    sent = sum(r["bytes_sent"] for r in senders)
    dense = sum(r["dense_bytes"] for r in senders)
    steps = min(clocks)
    global_bytes = sum(r["bytes_received"] + r["bytes_sent"] for r in shard_reports)
    # Steps pushed whose gradient no shard holds (lost with a local server's sums, or
    # with a shard's updates since its last checkpoint); a worker that redid a step
    # after a restart may have it twice.
    taken_in = [min(r["received"][w] for r in shard_reports) for w in range(len(clocks))]
    lost = sum(max(0, clock - got) for clock, got in zip(clocks, taken_in, strict=True))
    lag_steps = sum(r["steps"] for r in reports)
    corpus = build_corpus(cfg.data)
    return {
        "strategy": "ps",
        "world_size": cfg.scaling.num_workers,
        "device": reports[0]["device"],  # the workers' (a shard's is always the CPU)
        "steps": steps,
        "final_loss": eval_loss if eval_loss is not None else float("nan"),
        "eval_loss": eval_loss,
        **evaluation,
        **summary_bits_per_byte(cfg, eval_loss),  # text: against gzip -9 and xz -9
        "task": cfg.task.kind,
        "entropy_floor": corpus.loss_floor(cfg.model.block_size),
        "tokens_per_s": samples * cfg.tokens_per_sample / train_s,
        "samples_per_s": samples / train_s,
        "mfu": None,
        "peak_mem_bytes": max(r["peak_mem_bytes"] for r in reports),
        "train_s": train_s,
        "params": num_params(model),
        # a lost local server is not restarted (its workers are, and count here)
        "restarts": sum(board_report["worker_restarts"]) + len(board_report["shard_losses"]),
        "ps": {
            "consistency": s.consistency,
            "num_shards": s.num_shards,
            "updates": updates,
            "updates_per_s": updates / train_s,
            "pushes": int(staleness.size),
            "rejected": sum(r["rejected"] for r in shard_reports),
            "staleness_mean": float(staleness.mean()) if staleness.size else 0.0,
            "staleness_p50": float(np.percentile(staleness, 50)) if staleness.size else 0.0,
            "staleness_p99": float(np.percentile(staleness, 99)) if staleness.size else 0.0,
            "staleness_max": int(staleness.max()) if staleness.size else 0,
            # the mean factor staleness_lr put on the updates' lr (1: none scaled down)
            "lr_factor_mean": statistics.fmean(lr_factors) if lr_factors else 1.0,
            "clock_gap_max": board_report["gap_max"],
            "waits": board_report["waits"],
            "wait_s": board_report["wait_s"],
            "worker_clocks": clocks,
            "worker_steps_per_s": [
                r["steps"] / r["wall_s"] if r["wall_s"] else 0.0 for r in reports
            ],
            "worker_seconds": [r["seconds"] for r in reports],
            "worker_restarts": board_report["worker_restarts"],
            "shard_failures": board_report["shard_losses"],
            "bytes_pushed": sent,
            "compression_ratio": dense / sent if sent else 1.0,
            # what the global shards took in and sent out per step (pushes and pulls)
            "global_bytes_per_step": global_bytes / steps if steps else 0.0,
            "clock_lag_max": max(r["clock_lag_max"] for r in reports),
            "clock_lag_mean": sum(r["clock_lag_sum"] for r in reports) / lag_steps
            if lag_steps
            else 0.0,
            "pushes_lost": lost,
            "local_servers": [
                {k: r[k] for k in ("workers", "syncs", "bytes_sent")} for r in local_reports
            ],
            "local_servers_lost": locals_lost,
            "workers_on_shards": board_report["workers_on_shards"],
        },
    }


def _save_final(cfg: JobConfig, model: Any, *, run_dir: Path, summary: dict[str, Any]) -> Path:
    """The final weights as a standard checkpoint any strategy loads."""
    step = summary["steps"]
    name = ckpt.dir_name(step)
    samples_seen = step * cfg.train.global_batch_size
    corpus = build_corpus(cfg.data)
    with tempfile.TemporaryDirectory(prefix="trainstack-ps-") as tmp:
        staging = Path(tmp)
        entries = ckpt.write_rank_files(staging, {"model.pt": model.state_dict()})
        manifest = ckpt.build_manifest(
            step=step,
            samples_seen=samples_seen,
            tokens_seen=samples_seen * cfg.tokens_per_sample,
            spec=config_to_dict(cfg),
            model_shapes=ckpt.parameter_shapes(model),
            data={
                "fingerprint": corpus.fingerprint,
                "epoch": data_epoch(corpus, samples_seen, seq_len=cfg.model.block_size),
            },
            strategy="ps",
            world_size=cfg.scaling.num_workers,
            files=entries,
            metrics=summary,
        )
        ckpt.write_manifest(staging, manifest)
        DirectoryCheckpointStore(run_dir, rank=0, distributed=False).commit(
            staging, name=name, metrics=summary
        )
    return run_dir / name
