"""What a Ray cluster's nodes have installed, asked through its Job API by a small job
that needs nothing but Ray, so it answers on a cluster whose image lacks everything
else (`trainstack doctor --address`, `trainstack submit --deps pip|uv`)."""

from __future__ import annotations

import json
import os
import shlex
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trainstack.errors import first_line
from trainstack.stack import DEPENDENCIES

if TYPE_CHECKING:
    from ray.job_submission import JobSubmissionClient

PROBE_MARK = "trainstack-doctor:"
PROBE_TIMEOUT_S = 120.0
AUTH_HINT = (
    " (a cluster with token authentication: export RAY_AUTH_MODE=token, as for "
    "`ray job submit`; the token comes from RAY_AUTH_TOKEN or ~/.ray/auth_token)"
)


class ClusterProbeError(RuntimeError):
    """The cluster could not be asked; the message is one line."""


@dataclass(frozen=True)
class NodeVersions:
    address: str
    driver: bool
    """Whether the probe's driver ran there (a job's driver runs on the head node)."""
    versions: dict[str, str | None]

    def describe(self) -> str:
        return f"{self.address} (head)" if self.driver else self.address


def probe_script(names: list[str]) -> str:
    """A Python program that needs nothing but Ray: the versions of `names` on every
    alive node, printed as one JSON line after `PROBE_MARK`."""
    return f"""
import importlib.metadata as m, json, ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy as On
def versions():
    out = {{}}
    for name in {names!r}:
        try:
            out[name] = m.version(name)
        except m.PackageNotFoundError:
            out[name] = None
    return out
ray.init(log_to_driver=False)
here = ray.get_runtime_context().get_node_id()
nodes = [n for n in ray.nodes() if n["Alive"]]
probe = ray.remote(num_cpus=0)(versions)
asked = [probe.options(scheduling_strategy=On(n["NodeID"], soft=False)) for n in nodes]
got = ray.get([ask.remote() for ask in asked])
rows = [dict(address=n["NodeManagerAddress"], driver=n["NodeID"] == here, versions=v)
        for n, v in zip(nodes, got)]
print({PROBE_MARK!r} + json.dumps(rows), flush=True)
"""


ADDRESS_VARIABLES = ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS")


def job_client(address: str, **options: Any) -> JobSubmissionClient:
    """Ray's Job API client for `address`, the address given. Ray's client takes
    `$RAY_API_SERVER_ADDRESS`, else `$RAY_ADDRESS`, over the address it is handed (a
    leftover `RAY_ADDRESS` of another Ray would send `--address`'s job elsewhere): both
    are hidden while it resolves the address, which it keeps."""
    from ray.job_submission import JobSubmissionClient

    hidden = {name: os.environ.pop(name) for name in ADDRESS_VARIABLES if name in os.environ}
    try:
        return JobSubmissionClient(address, **options)
    finally:
        os.environ.update(hidden)


def probe_cluster(address: str) -> list[NodeVersions]:
    """Every alive node's library versions, asked through the cluster's Job API by a job
    that needs only Ray (so it answers on a cluster whose image lacks everything else)."""
    try:
        from ray.job_submission import JobStatus
    except ImportError as err:
        raise ClusterProbeError(f"Ray's job client does not import here: {err}") from err
    names = [dep.name for dep in DEPENDENCIES]
    entry = "python -c " + shlex.quote(probe_script(names))
    try:
        client = job_client(address)
        job = client.submit_job(entrypoint=entry, metadata={"job_name": "trainstack-doctor"})
    except Exception as err:
        message = first_line(err)
        hint = AUTH_HINT if "authentication" in message.lower() else ""
        raise ClusterProbeError(message + hint) from err
    deadline = time.monotonic() + PROBE_TIMEOUT_S
    while (status := client.get_job_status(job)) not in (
        JobStatus.SUCCEEDED,
        JobStatus.FAILED,
        JobStatus.STOPPED,
    ):
        if time.monotonic() > deadline:
            client.stop_job(job)
            raise ClusterProbeError(f"the probe job {job} did not end in {PROBE_TIMEOUT_S:.0f} s")
        time.sleep(0.5)
    logs = client.get_job_logs(job)
    for line in logs.splitlines():
        if line.startswith(PROBE_MARK):
            rows: list[dict[str, Any]] = json.loads(line[len(PROBE_MARK) :])
            return [
                NodeVersions(address=r["address"], driver=r["driver"], versions=r["versions"])
                for r in rows
            ]
    last = (logs.strip().splitlines() or [str(status)])[-1]
    raise ClusterProbeError(f"the probe job {job} ended {status}: {last}")


def head_ray_version(nodes: list[NodeVersions]) -> str | None:
    """The Ray version of the node the probe's driver ran on (a job's driver runs on the
    head), else of any node."""
    ordered = sorted(nodes, key=lambda node: not node.driver)
    return next((node.versions.get("ray") for node in ordered), None)
