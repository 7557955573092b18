"""Live training metrics reach Ray's Prometheus endpoint, and the shipped Grafana
dashboard asks only for series that trainstack exports.

The end-to-end test runs its jobs in a child process with a Ray instance of its own
(it exports metrics, which the session's `ray_cluster` fixture does not; Ray picks the
port and the child writes it to STORAGE/metrics_port) and scrapes
`http://127.0.0.1:PORT/metrics` from here. Run alone, the child is that process:
`python tests/ray/test_metrics_export.py STORAGE`.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from trainstack.config import config_from_dict
from trainstack.observe import prometheus
from trainstack.observe.prometheus import RunTelemetry, ShardTelemetry, run_id_for

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "dashboards" / "grafana_trainstack.json"
VOCAB = 16
PS_STEPS = 80

Samples = dict[str, list[tuple[dict[str, str], float]]]
"""Series name -> (labels, value) of every sample in a scrape."""


def job_spec(storage: str, *, name: str, strategy: dict[str, Any], **extra: Any) -> dict:
    return {
        "name": name,
        "model": {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 16},
        "data": {"vocab_size": VOCAB, "order": 1, "eval_samples": 0},
        "train": {"steps": 40, "global_batch_size": 16, "micro_batch_size": 8},
        "optim": {"lr": 1e-2, "warmup_steps": 2, "grad_clip": 0},
        "strategy": strategy,
        "scaling": {"num_workers": 2, "cpus_per_worker": 1},
        "checkpoint": {"storage_path": storage, "every_steps": 20},
        "log": {"every_steps": 5, "progress": "quiet"},
        **extra,
    }


def ddp_spec(storage: str) -> dict:
    # Its block's MLP is 4 experts, two on each rank (tokens cross by all-to-all).
    spec = job_spec(
        storage,
        name="metrics-ddp",
        strategy={"kind": "ddp", "expert_parallel": 2},
        compression={"kind": "fp16", "min_numel": 256},
    )
    spec["model"]["moe"] = {"experts": 4, "top_k": 2}
    return spec


def ps_spec(storage: str) -> dict:
    # Worker 0 dies before its step 12 once: Ray restarts it and it counts the restart.
    # More steps than DDP: a shard sets its rates once a second, and a step is short.
    # One shard: each shard actor costs seconds of start-up on 2 cores.
    spec = job_spec(
        storage,
        name="metrics-ps",
        strategy={"kind": "ps", "num_shards": 1, "consistency": "async"},
        failure={"max_failures": 1},
        faults={"kill_at_steps": [12], "rank": 0},
    )
    spec["train"]["steps"] = PS_STEPS
    return spec


def run_jobs_and_hold(storage: str) -> None:
    """The child: a Ray instance exporting metrics on a port it picks (written to
    STORAGE/metrics_port); a DDP job on Ray Train and a ps job; then it holds Ray up
    until its stdin closes, so the scrape still finds the series, and writes the jobs'
    summaries to STORAGE/summaries.json."""
    import ray
    from ray._private import worker

    from trainstack.runtime.launcher import run_job

    ray.init(
        address="local",  # a new instance, even beside a `ray start` cluster on this machine
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        _system_config={"metrics_report_interval_ms": 500},
    )
    port = worker.global_worker.node.metrics_export_port
    (Path(storage) / "metrics_port.partial").write_text(str(port))
    (Path(storage) / "metrics_port.partial").rename(Path(storage) / "metrics_port")
    summaries = {
        "ddp": run_job(config_from_dict(ddp_spec(storage))),
        "ps": run_job(config_from_dict(ps_spec(storage))),
    }
    (Path(storage) / "summaries.json").write_text(json.dumps(summaries, default=str))
    sys.stdin.read()
    ray.shutdown()


def scrape(port: int) -> Samples:
    """The trainstack series on Ray's metrics endpoint now (none while it is not up)."""
    from prometheus_client.parser import text_string_to_metric_families

    samples: Samples = defaultdict(list)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
            text = answer.read().decode()
    except OSError:
        return samples
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("ray_trainstack_"):
                samples[sample.name].append((sample.labels, sample.value))
    return samples


def values(samples: Samples, name: str, **labels: str) -> dict[str, float]:
    """`name`'s values whose labels include `labels`, by rank (or shard, or component)."""
    out = {}
    for got, value in samples.get(name, []):
        if all(got.get(k) == v for k, v in labels.items()):
            key = got.get("rank") or got.get("shard") or got.get("component") or ""
            out[key] = value
    return out


def watch(
    port: int,
    *,
    child: subprocess.Popen,
    done: Path,
    expected: list[tuple[str, dict[str, str], set[str]]],
) -> Samples:
    """Scrape every second while `child` runs its jobs, until `done` exists and every
    expected (series, labels, ranks or shards) has been seen, keeping each series'
    latest value (the test's timeout ends a wait for a series never exported; what is
    still missing is printed at each scrape after the jobs are done). Scraping all along
    matters: a gauge leaves the endpoint about two report intervals after the worker
    that set it exits."""
    latest: dict[tuple[str, tuple[tuple[str, str], ...]], tuple[dict[str, str], float]] = {}
    while True:
        assert done.exists() or child.poll() is None, f"the jobs' process exited: {child.args}"
        for name, found in scrape(port).items():
            for labels, value in found:
                latest[name, tuple(sorted(labels.items()))] = (labels, value)
        seen: Samples = defaultdict(list)
        for (name, _), sample in latest.items():
            seen[name].append(sample)
        missing = [(n, lab) for n, lab, keys in expected if keys - set(values(seen, n, **lab))]
        if done.exists():
            if not missing:
                return seen
            print(f"not exported yet: {missing}", flush=True)
        time.sleep(1)


@pytest.mark.slow
@pytest.mark.timeout(420)  # ends a wait for a series that never reaches the endpoint
def test_ddp_and_ps_jobs_export_live_metrics_to_prometheus(
    state_api_of_no_other_instance: None, tmp_path: Path
) -> None:
    storage = str(tmp_path / "runs")
    Path(storage).mkdir()
    with (tmp_path / "child.log").open("w") as log:
        child = subprocess.Popen(
            [sys.executable, __file__, storage],
            stdin=subprocess.PIPE,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
    summaries_path = Path(storage) / "summaries.json"
    ddp = {"job_name": "metrics-ddp", "run_id": run_id_for(Path(storage) / "metrics-ddp")}
    ps = {"job_name": "metrics-ps", "run_id": run_id_for(Path(storage) / "metrics-ps")}
    ranks = {"0", "1"}
    port_file = Path(storage) / "metrics_port"
    while not port_file.exists():  # the child's Ray is starting
        assert child.poll() is None, (tmp_path / "child.log").read_text()[-5000:]
        time.sleep(0.2)
    port = int(port_file.read_text())
    try:
        samples = watch(
            port,
            child=child,
            done=summaries_path,
            expected=[
                ("ray_trainstack_loss", ddp, ranks),
                ("ray_trainstack_tokens_per_second", ddp, ranks),
                ("ray_trainstack_checkpoint_save_seconds", ddp, ranks),
                ("ray_trainstack_time_spent_seconds", {**ddp, "part": "steps"}, ranks),
                ("ray_trainstack_moe_load_cv", ddp, ranks),
                ("ray_trainstack_loss", ps, ranks),
                ("ray_trainstack_comm_exposed_ratio", ps, ranks),
                ("ray_trainstack_ps_updates_per_second", ps, {"0"}),
                ("ray_trainstack_ps_shard_queue_depth", ps, {"0"}),
                ("ray_trainstack_ps_staleness_updates_count", ps, {"0"}),
                ("ray_trainstack_restarts_total", ps, {"ps_worker"}),
            ],
        )
    except AssertionError:
        print((tmp_path / "child.log").read_text()[-5000:])
        raise
    finally:
        assert child.stdin is not None
        child.stdin.close()
        try:
            child.wait(timeout=60)
        except subprocess.TimeoutExpired:
            child.kill()
    summaries = json.loads(summaries_path.read_text())
    assert summaries["ddp"]["steps"] == 40 and summaries["ps"]["steps"] == PS_STEPS
    # The untrained model's loss is 2.72 (ln 16 = 2.77); trained, the gauges read (measured)
    # 1.24 (DDP, its last step) and 1.29 and 1.42 (ps), against the floor's 1.14. Below
    # floor + 0.8 the gauge shows a trained model, even if the last scrape was a few
    # steps before the end (DDP's step 10 already logs 1.84).
    learned = summaries["ddp"]["entropy_floor"] + 0.8
    assert summaries["ddp"]["final_loss"] < summaries["ddp"]["entropy_floor"] + 0.3

    # DDP on Ray Train: both ranks report the group's loss and their share of throughput.
    loss = values(samples, "ray_trainstack_loss", **ddp)
    assert set(loss) == {"0", "1"}
    assert all(0 < v < learned for v in loss.values()), loss
    tokens = values(samples, "ray_trainstack_tokens_per_second", **ddp)
    step_s = values(samples, "ray_trainstack_step_time_seconds", **ddp)
    for rank in ("0", "1"):
        assert tokens[rank] > 0 and step_s[rank] > 0
        # The rank's share of the group's throughput: half a global batch per step.
        assert tokens[rank] == pytest.approx(16 * 16 / 2 / step_s[rank], rel=1e-6)
    assert all(v > 0 for v in values(samples, "ray_trainstack_peak_memory_bytes", **ddp).values())
    assert all(v > 0 for v in values(samples, "ray_trainstack_step_wire_bytes", **ddp).values())
    ratio = values(samples, "ray_trainstack_compression_ratio", **ddp)
    assert all(1.2 < v <= 2.0 for v in ratio.values())  # fp16 on the large tensors
    saves = values(samples, "ray_trainstack_checkpoint_save_seconds", **ddp)
    assert all(v > 0 for v in saves.values())
    # Goodput's live part: seconds in steps so far, within the run's own training time.
    in_steps = values(samples, "ray_trainstack_time_spent_seconds", **ddp, part="steps")
    assert set(in_steps) == {"0", "1"}
    assert all(0 < v <= summaries["ddp"]["train_s"] for v in in_steps.values()), in_steps
    assert not values(samples, "ray_trainstack_mfu_ratio", **ddp)  # CPU: peak FLOP/s unknown
    # The routing, summed over both ranks: near even (a collapsed router reads 1.7), none
    # dropped (no capacity limit).
    assert all(0 <= v < 0.5 for v in values(samples, "ray_trainstack_moe_load_cv", **ddp).values())
    assert set(values(samples, "ray_trainstack_moe_drop_rate", **ddp).values()) == {0.0}
    assert summaries["ddp"]["moe_drop_rate"] == 0.0

    # The parameter server: its workers' steps, its shards' pushes, and the restart.
    ps_loss = values(samples, "ray_trainstack_loss", **ps)
    assert set(ps_loss) == {"0", "1"}
    assert all(0 < v < learned for v in ps_loss.values()), ps_loss
    comm = values(samples, "ray_trainstack_comm_exposed_ratio", **ps)
    assert all(0 < v <= 1 for v in comm.values())
    assert values(samples, "ray_trainstack_ps_updates_per_second", **ps)["0"] > 0
    depth = values(samples, "ray_trainstack_ps_shard_queue_depth", **ps)["0"]
    assert 0 < depth <= 3  # 2 workers, at most one push each in flight
    # The shard sees every worker's push of every step, and the restarted worker's
    # replays of steps whose clock update died with it (at most the 11 before the kill);
    # the last second's pushes may not reach the endpoint before the driver stops it.
    pushes = values(samples, "ray_trainstack_ps_staleness_updates_count", **ps)["0"]
    assert PS_STEPS <= pushes <= 2 * PS_STEPS + 11
    restarts = values(samples, "ray_trainstack_restarts_total", **ps)
    assert restarts == {"ps_worker": 1.0}
    assert not values(samples, "ray_trainstack_restarts_total", **ddp)


def test_telemetry_is_off_without_ray_and_never_raises(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    cfg = config_from_dict(ddp_spec(str(tmp_path)))
    monkeypatch.setattr(prometheus, "ray_connected", lambda: False)
    off = RunTelemetry.for_rank(cfg, rank=0, world_size=2, run_dir=tmp_path / "metrics-ddp")
    assert not off.enabled
    off.record_step({})  # a record missing every key: not even looked at

    def broken(series: prometheus.ExportedSeries) -> Any:
        raise RuntimeError("metrics agent gone")

    monkeypatch.setattr(prometheus, "ray_connected", lambda: True)
    monkeypatch.setattr(prometheus, "_instrument", broken)
    on = RunTelemetry.for_rank(cfg, rank=1, world_size=2, run_dir=tmp_path / "metrics-ddp")
    on.record_checkpoint(0.5)  # the error turns it off, and training goes on
    assert not on.enabled
    shard = ShardTelemetry.for_shard(cfg, index=0, run_dir=tmp_path / "metrics-ddp")
    shard.record_push(staleness=3, sent_at=time.time())
    assert not shard.enabled


def dashboard_queries(dashboard: dict[str, Any]) -> list[str]:
    """The PromQL of the dashboard's panels and variables."""
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    variables = dashboard["templating"]["list"]
    return exprs + [v["definition"] for v in variables if v["type"] == "query"]


def test_grafana_dashboard_queries_only_exported_series_and_tags() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = dashboard_queries(dashboard)
    used = {name for q in queries for name in re.findall(r"\bray_trainstack_\w+", q)}
    exported = {name for series in prometheus.SERIES for name in series.exported_names}
    assert used <= exported, f"not exported by observe.prometheus: {sorted(used - exported)}"
    assert {s.exported_names[0] for s in prometheus.SERIES} <= used  # every series on a panel

    labels = {label for q in queries for label in re.findall(r'(\w+)=~?"', q)}
    for q in queries:
        for group in re.findall(r"\bby \(([^)]*)\)", q):
            labels |= {label.strip() for label in group.split(",")}
    tags = {tag for series in prometheus.SERIES for tag in series.tags}
    assert labels <= tags | {"le"}, f"not a trainstack tag: {sorted(labels - tags - {'le'})}"
    assert any(v["type"] == "datasource" for v in dashboard["templating"]["list"])


if __name__ == "__main__":
    run_jobs_and_hold(sys.argv[1])
