"""The chaos table: every fault × strategy on a simulated multi-node cluster, measured.

A head with no CPUs and 1-CPU worker nodes on this machine (the suite's harness,
`tests/cluster/multinode.py`), a 2-worker job (tiny GPT, checkpoint every 5 steps, 30
steps, steps slowed to 0.1 s so faults land mid-run), and one fault per run:

    worker kill      the test-only injector kills rank 1's process before step 13
    node, mid-step   a worker node is hard-killed when the driver hears of step 12
    node, checkpoint ... when it hears of step 10, as checkpoint 10 is written (the
                     save is cut when the kill lands before it is uploaded)
    store outage     the local S3 (moto) holding the checkpoints stops at step 12 for
                     12 s (DDP; checkpoints in s3://)
    resize up/down   an elastic group {min: 1, max: 3} of 2 grows to 3 when a node
                     joins, then shrinks to 1 when two are lost (DDP)
    ps shard node    the node holding both parameter-server shards (one that does
                     not train) is lost at step 20 (ssp, 80 steps)

After a node kill a replacement node joins at once. Per run: steps lost (summed over
restarts), recovery seconds (fault → the first completed step after it; the sum when
there were several attempts) and whether the final weights equal an uninterrupted
fixed-size run's (bitwise; elastic: the largest difference).

    python benchmarks/chaos.py                 # all rows, about 10 minutes on 2 cores
    python benchmarks/chaos.py --only ddp      # rows whose strategy or fault matches
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests/cluster"))
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.25")

import ray  # noqa: E402
import torch  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from trainstack import checkpoint as ckpt  # noqa: E402
from trainstack.config import config_from_dict  # noqa: E402
from trainstack.runtime.gloo_processes import run_processes  # noqa: E402
from trainstack.runtime.launcher import RunFailedError, run_job  # noqa: E402

from multinode import FAST_FAILURE_DETECTION, WORKER_NODE, SimulatedCluster  # noqa: E402

STRATEGIES: dict[str, dict[str, Any]] = {
    "ddp": {"kind": "ddp"},
    "zero2": {"kind": "zero", "stage": 2},
    "pipeline": {"kind": "pipeline", "stages": 2, "microbatches": 6},
}
STEPS, EVERY = 30, 5


def spec(root: Path, name: str, strategy: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": name,
        "model": {"kind": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 8},
        "data": {"vocab_size": 16, "order": 1, "eval_samples": 16},
        "train": {"steps": STEPS, "global_batch_size": 12, "micro_batch_size": 2},
        "optim": {"lr": 1e-2, "warmup_steps": 2},
        "strategy": strategy,
        "scaling": {"num_workers": 2, "resources_per_worker": {WORKER_NODE: 1}},
        "checkpoint": {"every_steps": EVERY, "storage_path": str(root / "runs")},
        "failure": {"max_failures": 6},
        "log": {"every_steps": 1, "progress": "quiet"},
        "faults": {"step_delay_s": 0.1},
    }


class Follow:
    """Records the run's events and does `act(record)` on each."""

    def __init__(self, act: Callable[[dict[str, Any]], float | None]) -> None:
        self.act = act
        self.fault_times: list[float] = []
        self.first_steps: list[float] = []
        self.starts: list[dict[str, Any]] = []

    def __call__(self, record: dict[str, Any]) -> None:
        event = record.get("event")
        if event == "first_step":
            self.first_steps.append(record["time"])
        elif event == "start":
            self.starts.append(record)
        elif event == "fault":
            self.fault_times.append(record["time"])
        at = self.act(record)
        if at is not None:
            self.fault_times.append(at)

    def recovery_s(self) -> float:
        """Fault → the first completed step after it, summed over the faults."""
        total = 0.0
        for fault in self.fault_times:
            after = [t for t in self.first_steps if t > fault]
            total += after[0] - fault if after else float("nan")
        return total


def reference(root: Path, raw: dict[str, Any], *, world_size: int) -> dict[str, torch.Tensor]:
    ref = {**raw, "name": f"{raw['name']}-ref", "faults": {}}
    ref["scaling"] = {"num_workers": world_size}
    ref["checkpoint"] = {"storage_path": str(root / "ref-runs")}
    out = root / f"{raw['name']}-ref"
    run_processes(config_from_dict(ref), world_size=world_size, out_dir=out)
    state: dict[str, torch.Tensor] = torch.load(out / "model.pt", weights_only=True)
    return state


def compare(summary: dict[str, Any], raw: dict[str, Any], expected: dict[str, Any]) -> float:
    final = ckpt.resolve(ckpt.checkpoints_for(config_from_dict(raw)))
    weights = final.full_weights()
    return max((weights[k] - v).abs().max().item() for k, v in expected.items())


def node_kill(sim: SimulatedCluster, at_step: int) -> Callable[[dict[str, Any]], float | None]:
    done: list[int] = []

    def act(record: dict[str, Any]) -> float | None:
        if done or "event" in record or record["step"] != at_step:
            return None
        done.append(at_step)
        when = time.time()
        sim.kill(sim.nodes[0])
        sim.add_worker()  # a replacement machine joins
        return when

    return act


def row(fault: str, strategy: str, follow: Follow, summary: dict[str, Any], diff: float) -> dict:
    lost = [r["steps_lost"] for r in summary.get("recovery", []) if r["steps_lost"] is not None]
    return {
        "fault": fault,
        "strategy": strategy,
        "restarts": summary["restarts"],
        "steps_lost": sum(lost),
        "recovery_s": round(follow.recovery_s(), 1),
        "final_weights": "bitwise equal" if diff == 0 else f"max diff {diff:.2g}",
        "resizes": summary.get("resizes", []),
    }


def fixed_rows(sim: SimulatedCluster, root: Path, only: str) -> list[dict[str, Any]]:
    rows = []
    for strategy, section in STRATEGIES.items():
        faults = {
            "worker kill": None,
            "node lost mid-step": 12,
            "node lost at a checkpoint step": EVERY * 2,
        }
        expected: dict[str, Any] | None = None
        for fault, at_step in faults.items():
            if only and only not in strategy and only not in fault:
                continue
            sim.workers(2)
            name = f"{strategy}-{fault.split()[0]}-{at_step or 0}"
            raw = spec(root, name, section)
            if at_step is None:
                raw["faults"] = {**raw["faults"], "kill_at_steps": [13], "rank": 1}
            follow = Follow(node_kill(sim, at_step) if at_step else lambda record: None)
            summary = run_job(config_from_dict(raw), on_record=follow)
            if expected is None:
                expected = reference(root, raw, world_size=2)
            rows.append(row(fault, strategy, follow, summary, compare(summary, raw, expected)))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def outage_row(sim: SimulatedCluster, root: Path) -> dict[str, Any]:
    import boto3
    from moto.server import ThreadedMotoServer

    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        os.environ[key] = "testing"
    os.environ["AWS_DEFAULT_REGION"] = "us-east-1"
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    port = server.get_host_and_port()[1]  # the store comes back on the same port
    endpoint = f"http://127.0.0.1:{port}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="chaos")
    sim.workers(2)
    raw = spec(root, "ddp-outage", STRATEGIES["ddp"])
    raw["checkpoint"] = {
        **raw["checkpoint"],
        "storage_path": "s3://chaos/runs",
        "storage_options": {"endpoint_override": endpoint, "scheme": "http"},
    }
    servers = [server]  # the running one last
    began: list[float] = []

    def back_later() -> None:
        time.sleep(12)
        again = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        again.start()  # the objects live in this process: it serves what it held
        servers.append(again)

    def act(record: dict[str, Any]) -> float | None:
        if began or "event" in record or record["step"] != 12:
            return None
        began.append(time.time())
        server.stop()
        threading.Thread(target=back_later, daemon=True).start()
        return began[0]

    follow = Follow(act)
    try:
        summary = run_job(config_from_dict(raw), on_record=follow)
    except RunFailedError as err:
        return {"fault": "object store down 12 s", "strategy": "ddp", "failed": str(err)}
    expected = reference(root, raw, world_size=2)
    result = row("object store down 12 s", "ddp", follow, summary, compare(summary, raw, expected))
    servers[-1].stop()
    return result


def ps_row(sim: SimulatedCluster, root: Path) -> dict[str, Any]:
    """The node holding both parameter-server shards (a node that does not train) lost
    mid-run; a replacement joins."""
    sim.workers(3)
    service = sim.add_service_node(cpus=2)
    raw = spec(root, "ps-shard-node", {})
    raw["model"]["n_layer"] = 1
    raw["optim"]["grad_clip"] = 0
    raw["strategy"] = {
        "kind": "ps",
        "num_shards": 2,
        "consistency": "ssp",
        "staleness_bound": 1,
        "checkpoint_every_updates": 4,
    }
    raw["train"] = {"steps": 80, "global_batch_size": 12, "micro_batch_size": 6}
    raw["log"]["every_steps"] = 2
    raw["faults"] = {"step_delay_s": 0.05}
    killed: list[tuple[float, int]] = []
    back: list[float] = []

    def act(record: dict[str, Any]) -> None:
        if "event" in record:
            return
        if not killed and record["step"] >= 20:
            killed.append((time.time(), record["step"]))
            sim.kill(service)
            sim.add_worker()
        elif killed and not back and record["step"] >= killed[0][1] + 4:
            back.append(time.time())

    summary = run_job(config_from_dict(raw), on_record=act)
    lost = [f["updates_lost"] for f in summary["ps"]["shard_failures"]]
    return {
        "fault": "node holding both ps shards lost",
        "strategy": "ps (ssp, 2 shards)",
        "restarts": len(lost),
        "steps_lost": f"{max(lost, default=0)} updates per shard",
        "recovery_s": round(back[0] - killed[0][0], 1) if back else None,
        "final_weights": f"n/a (ssp); held-out loss {summary['final_loss']:.3f}, "
        f"floor {summary['entropy_floor']:.3f}",
    }


def elastic_rows(sim: SimulatedCluster, root: Path) -> list[dict[str, Any]]:
    sim.workers(2)
    raw = spec(root, "elastic", STRATEGIES["ddp"])
    raw["train"]["steps"] = 120
    raw["scaling"] = {
        "num_workers": {"min": 1, "max": 3},
        "resources_per_worker": {WORKER_NODE: 1},
        "resize_check_s": 1,
        "start_timeout_s": 25,
    }
    raw["faults"] = {"step_delay_s": 0.25}
    sizes: list[tuple[int, int]] = []
    acted: list[float] = []

    def act(record: dict[str, Any]) -> float | None:
        if record.get("event") == "start":
            sizes.append((record["world_size"], record["resumed_from_step"]))
        if "event" in record or not sizes:
            return None
        size, since = sizes[-1]
        if not acted and size == 2 and record["step"] >= 4:
            acted.append(time.time())
            sim.add_worker()
            return acted[-1]
        if len(acted) == 1 and size == 3 and record["step"] >= since + 4:
            acted.append(time.time())
            for node in sim.nodes[:2]:
                sim.kill(node)
            return acted[-1]
        return None

    follow = Follow(act)
    summary = run_job(config_from_dict(raw), on_record=follow)
    expected = reference(root, raw, world_size=1)
    diff = compare(summary, raw, expected)
    out = []
    for resize, fault_time in zip(summary["resizes"], acted, strict=False):
        after = [t for t in follow.first_steps if t > fault_time]
        out.append(
            {
                "fault": f"resize {resize['from']} → {resize['to']} ({resize['reason']})",
                "strategy": "ddp elastic",
                "restarts": 1,
                "steps_lost": None,
                "recovery_s": round(after[0] - fault_time, 1) if after else None,
                "final_weights": f"max diff {diff:.2g} vs a fixed 1-worker run",
                "resumed_from_step": resize["step"],
            }
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="run the rows whose name has this text")
    parser.add_argument("--out", default=str(ROOT / ".cache/bench/chaos.json"))
    args = parser.parse_args()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "_system_config": FAST_FAILURE_DETECTION},
    )
    ray.init(address=cluster.address, log_to_driver=False)
    sim = SimulatedCluster(cluster)
    root = Path(tempfile.mkdtemp(prefix="trainstack-chaos-"))
    rows: list[dict[str, Any]] = []
    try:
        rows += fixed_rows(sim, root, args.only)
        if not args.only or args.only in "ddp outage":
            rows.append(outage_row(sim, root))
            print(json.dumps(rows[-1]), flush=True)
        if not args.only or args.only in "ddp elastic resize":
            rows += elastic_rows(sim, root)
        if not args.only or args.only in "ps shard":
            rows.append(ps_row(sim, root))
    finally:
        ray.shutdown()
        cluster.shutdown()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2))
    print("\n| fault | strategy | restarts | steps lost | recovery s | final weights |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if "failed" in r:
            print(f"| {r['fault']} | {r['strategy']} | - | - | - | run failed: {r['failed']} |")
            continue
        lost = "-" if r["steps_lost"] is None else r["steps_lost"]
        print(
            f"| {r['fault']} | {r['strategy']} | {r['restarts']} | {lost} | "
            f"{r['recovery_s']} | {r['final_weights']} |"
        )


if __name__ == "__main__":
    main()
