"""`ParameterServerWorker`: computes gradients on its data shard and pushes them.

Worker w of N reads its slice of each global batch of the job's sample stream (the
same `ShardedBatches` as the synchronous strategies, rank w of N), so N workers at
the same clock together see exactly one global batch. A step: wait for its turn
(ssp, bsp), pull fresh parameters every `pull_every` steps, forward/backward over
its micro-batches, push each shard its slice of the gradient (compressed, with error
feedback kept here, when the spec says so), and tell the clock board.

With local servers (ps/local.py) it pushes its dense gradient to its local server and
pulls from it instead; once that server is gone (its node lost), it tells the board and
goes to the shards directly. Each step it notes how many clocks behind its own the
parameters it computes with are (`complete`, from the shards): `ps.clock_lag_max`.

Restarted by Ray after a crash, it asks the board for the clock it had reached,
resumes its data cursor there, and pulls fresh parameters; the other workers never
stop. Its error-feedback residuals start again from zero.
"""

from __future__ import annotations

import time
from typing import Any, cast

import ray
import torch

from trainstack.config import config_from_dict
from trainstack.data import build_corpus
from trainstack.data.sharding import ShardedBatches
from trainstack.faults import FaultInjector
from trainstack.models import build_model
from trainstack.observe.prometheus import PsWorkerTelemetry
from trainstack.observe.throughput import peak_memory_bytes
from trainstack.ps.clock import ActorNames
from trainstack.ps.partition import ShardLayout
from trainstack.ps.shard import Pulled, encode_push, push_codecs
from trainstack.strategies.base import apply_compile, autocast, to_device
from trainstack.tasks import build_task


class ParameterServerWorker:
    def __init__(
        self,
        *,
        index: int,
        spec: dict[str, Any],
        layouts: list[ShardLayout],
        names: ActorNames,
        run_dir: str,
    ) -> None:
        from pathlib import Path

        self.cfg = cfg = config_from_dict(spec)
        torch.set_num_threads(cfg.scaling.torch_threads)
        self.index = index
        self.layouts = layouts
        self.names = names
        self.shards: list[Any] = [names.find(names.shard(i)) for i in range(len(layouts))]
        self.local: Any = None
        """Its local server, when the job has them (set by `run`)."""
        self.board: Any = names.find(names.board)
        board = self.board
        # With scaling.use_gpu Ray gave this actor a GPU of its own (cuda:0 here).
        self.device = torch.device("cuda" if cfg.scaling.use_gpu else "cpu")
        self.model = build_model(cfg.model, vocab_size=cfg.data.vocab_size, seed=cfg.train.seed)
        self.model.to(self.device)
        apply_compile(cfg, self.model)
        self.params = dict(self.model.named_parameters())
        self.task = build_task(cfg)
        self.clock: int = cast(int, ray.get(board.worker_started.remote(index)))
        self.batches = ShardedBatches.for_job(
            cfg,
            build_corpus(cfg.data),
            rank=index,
            world_size=cfg.scaling.num_workers,
            samples_seen=self.clock * cfg.train.global_batch_size,
        )
        self.compressors, self.feedback = push_codecs(cfg, shards=len(layouts), rank=index)
        self.faults = FaultInjector(
            cfg, rank=index, marker_dir=Path(run_dir) / "faults", on_fire=lambda record: None
        )
        self.versions = [0] * len(layouts)
        """Shard versions of the parameters this worker computes with."""
        self.complete = 0
        """The clock up to which those parameters hold every worker's gradients."""
        self.lag_max = 0
        self.lag_sum = 0
        self.prefetched = False
        """Whether the last push brought back the parameters for this step."""
        self.seconds = {"compute": 0.0, "push": 0.0, "pull": 0.0, "wait": 0.0, "slow": 0.0}
        self.bytes_sent = 0
        self.dense_bytes = 0
        """Bytes (as sent, and dense) this worker pushed to the shards directly."""
        self.steps_done = 0
        self.telemetry = PsWorkerTelemetry.for_worker(cfg, index=index, run_dir=Path(run_dir))
        self.telemetry.record_actor_start("ps_worker")
        torch.manual_seed(cfg.train.seed + 1 + index)

    def node(self) -> str:
        """The Ray node this worker runs on."""
        return str(ray.get_runtime_context().get_node_id())

    def run(self, deadline: float | None = None, local: int | None = None) -> dict[str, Any]:
        """Train until this worker has pushed `train.steps` steps (or the wall clock passes
        `deadline`, a `time.time()`), through local server `local` when given; return its
        figures."""
        s = self.cfg.strategy
        if local is not None:
            try:
                self.local = self.names.find(self.names.local(local))
            except ValueError:  # lost before this (restarted) worker came up
                self._fall_back()
        pulled_at = None
        start = time.perf_counter()
        while self.clock < self.cfg.train.steps:
            if deadline is not None and time.time() >= deadline:
                break
            step_start = time.perf_counter()
            self.faults.before_step(self.clock + 1)
            if s.consistency != "async":
                t = time.perf_counter()
                ray.get(self.board.wait_turn.remote(self.index, self.clock))
                self.seconds["wait"] += time.perf_counter() - t
            if pulled_at is None or self.clock - pulled_at >= s.pull_every:
                if not self.prefetched:
                    self._pull()
                pulled_at = self.clock
            self.prefetched = False
            lag = self.clock - self.complete
            self.lag_max = max(self.lag_max, lag)
            self.lag_sum += lag
            t = time.perf_counter()
            loss = self._gradients()
            compute = time.perf_counter() - t
            self.seconds["compute"] += compute
            if self.index == self.cfg.faults.slow_rank:  # a slower device: compute takes longer
                delay = (self.cfg.faults.slow_factor - 1.0) * compute
                time.sleep(delay)
                self.seconds["slow"] += delay
            # Async: a push whose next step pulls brings the parameters back with it.
            pull_next = (
                s.consistency == "async"
                and self.local is None
                and self.clock + 1 - pulled_at >= s.pull_every
            )
            versions = self._push(pull=pull_next)
            self.clock += 1
            self.steps_done += 1
            # Losses and versions for the board; the next wait_turn carries the clock itself.
            self.board.advance.remote(self.index, self.clock, loss, versions)
            self.telemetry.record_push_step(
                loss=loss,
                step_s=time.perf_counter() - step_start,
                comm_s_total=self.seconds["push"] + self.seconds["pull"],
                bytes_sent_total=self.bytes_sent,
                dense_bytes_total=self.dense_bytes,
            )
        ray.get(self.board.stop.remote(self.index))
        return {
            "worker": self.index,
            "steps": self.steps_done,
            "wall_s": time.perf_counter() - start,
            "seconds": self.seconds,
            "bytes_sent": self.bytes_sent,
            "dense_bytes": self.dense_bytes,
            "clock_lag_max": self.lag_max,
            "clock_lag_sum": self.lag_sum,
            "peak_mem_bytes": peak_memory_bytes(self.device),
            "device": self.device.type,
        }

    def _pull(self) -> None:
        t = time.perf_counter()
        pulled = self._from_local("pull", self.clock)
        if pulled is None:
            pulled = ray.get([shard.pull.remote() for shard in self.shards])
        self._set_parameters(pulled)
        self.seconds["pull"] += time.perf_counter() - t

    def _from_local(self, method: str, *args: Any) -> Any:
        """`method(*args)` on the local server; None when there is none, or it is gone
        (then this worker falls back to the shards)."""
        if self.local is None:
            return None
        try:
            return ray.get(getattr(self.local, method).remote(*args))
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
            self._fall_back()
            return None

    def _fall_back(self) -> None:
        self.local = None
        self.board.fell_back.remote(self.index)

    @torch.no_grad()
    def _set_parameters(self, pulled: list[Pulled]) -> None:
        for i, (version, flat, _) in enumerate(pulled):
            self.versions[i] = version
            for name, value in self.layouts[i].unflatten(flat).items():
                self.params[name].copy_(value)
        self.complete = min(complete for _, _, complete in pulled)

    def _gradients(self) -> float:
        """Mean loss over this worker's micro-batches of the step; gradients left in .grad."""
        self.model.zero_grad(set_to_none=True)
        micro_batches = self.batches.next_step()
        total = 0.0
        for x, y in micro_batches:
            x, y = to_device((x, y), self.device, pin_memory=self.cfg.train.pin_memory)
            with autocast(self.cfg, self.device):
                loss = self.task.loss(self.task.outputs(self.model, x, y), y, inputs=x)
            (loss / len(micro_batches)).backward()
            total += loss.item()
        return total / len(micro_batches)

    def _push(self, *, pull: bool) -> list[int]:
        """Push this step's gradients to every shard and return their versions after it;
        with `pull`, take the parameters they send back as the next step's."""
        t = time.perf_counter()
        # the wire and the codecs work on host memory
        grads = {name: p.grad.cpu() for name, p in self.params.items() if p.grad is not None}
        if self.local is not None:  # dense to the local server, which sums and sends on
            flats = [layout.flatten(grads) for layout in self.layouts]
            versions = self._from_local("push", self.index, self.clock, self.versions, flats)
            if versions is not None:
                self.seconds["push"] += time.perf_counter() - t
                return cast(list[int], versions)
        refs = []
        for i, (shard, layout) in enumerate(zip(self.shards, self.layouts, strict=True)):
            wire, nbytes = encode_push(
                grads,
                layout,
                compressor=self.compressors[i],
                feedback=self.feedback[i],
                clock=self.clock,
            )
            self.bytes_sent += nbytes
            self.dense_bytes += layout.numel * 4
            refs.append(
                shard.push.remote(
                    self.index, self.clock, self.versions[i], wire, pull=pull, sent_at=time.time()
                )
            )
        answers = ray.get(refs)
        if pull:
            self._set_parameters(answers)
            self.prefetched = True
        self.seconds["push"] += time.perf_counter() - t
        return [version for version, _, _ in answers]
